-- tower-admission: what the credit and receive scripts share, prepended
-- to each of them.

-- Notes on `state` (a region's state hash) the latest debit number `seq`
-- (a string of digits) seen from region `from` in its epoch `epoch`: the
-- field from:<from> moves to `epoch:seq` when the epoch changed or the
-- number grew, never back.
local function note_sent_seq(state, from, seq, epoch)
  local field = 'from:' .. from
  local seen = redis.call('HGET', state, field)
  local seen_epoch, seen_seq
  if seen then
    seen_epoch, seen_seq = string.match(seen, '^([^:]*):(%d+)$')
  end
  if seen_epoch ~= epoch or tonumber(seen_seq) < tonumber(seq) then
    redis.call('HSET', state, field, epoch .. ':' .. seq)
  end
end

