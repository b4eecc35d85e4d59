use std::collections::VecDeque;

use crate::quota::algorithm::{micros, never, Hold};
use crate::quota::Decision;
use crate::ConfigError;

/// The largest limit and window (µs) the Lua script decides exactly: every
/// intermediate stays below 2^53 (times below 2^52 µs, about the year 2112;
/// cumulative costs are kept modulo 2^52 there).
#[cfg(feature = "redis")]
const LUA_MAX: u64 = 1 << 50;

/// The first sequence number of an empty log is at most this, so numbering
/// a log's entries never overflows.
const SEQ_START_MAX: u64 = u64::MAX >> 1;

#[doc = include_str!("../../../docs/sliding_log.md")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlidingLog {
    limit: u64,
    window: u64,
}

/// Admissions still inside the window, oldest first. See [`SlidingLog`] for
/// the layout.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SlidingLogState {
    /// `(time in µs, cumulative cost)` of each admission, oldest first.
    entries: Entries,
    /// Sequence number of the front entry; of the next entry when empty.
    front_seq: u64,
    /// Cost held by the entries.
    total: u64,
    /// Time of the oldest entry (0 when empty).
    oldest: u64,
    /// Time of the newest entry (0 when empty).
    newest: u64,
}

/// The entries `(time in µs, cumulative cost)` of a log, oldest first: one
/// entry inline, more in a ring buffer of 8 bytes an entry (times and
/// cumulative costs as 32-bit offsets from a base) while they fit, else of
/// 16 bytes an entry.
#[derive(Debug, Clone, Default)]
enum Entries {
    #[default]
    Empty,
    One(u64, u64),
    /// Entry `i` is `(time + ring[i].0, cum + ring[i].1)`.
    Packed {
        time: u64,
        cum: u64,
        ring: VecDeque<(u32, u32)>,
    },
    Wide(VecDeque<(u64, u64)>),
}

/// Equal entries, whatever their layout.
impl PartialEq for Entries {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && (0..self.len()).all(|i| self.get(i) == other.get(i))
    }
}

impl Eq for Entries {}

impl Entries {
    fn len(&self) -> usize {
        match self {
            Entries::Empty => 0,
            Entries::One(..) => 1,
            Entries::Packed { ring, .. } => ring.len(),
            Entries::Wide(ring) => ring.len(),
        }
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    fn get(&self, i: usize) -> Option<(u64, u64)> {
        match self {
            Entries::Empty => None,
            Entries::One(t, c) => (i == 0).then_some((*t, *c)),
            Entries::Packed { time, cum, ring } => ring
                .get(i)
                .map(|&(t, c)| (time + u64::from(t), cum.wrapping_add(u64::from(c)))),
            Entries::Wide(ring) => ring.get(i).copied(),
        }
    }

    /// `(t, c)` as offsets from `(time, cum)`, if they fit.
    fn offsets(time: u64, cum: u64, (t, c): (u64, u64)) -> Option<(u32, u32)> {
        let t = u32::try_from(t.checked_sub(time)?).ok()?;
        let c = u32::try_from(c.wrapping_sub(cum)).ok()?;
        Some((t, c))
    }

    /// Every entry and then `last`, packed from the front entry, if they fit.
    fn packed(&self, last: (u64, u64)) -> Option<Entries> {
        let (time, cum) = self.get(0).unwrap_or(last);
        let ring = (0..self.len())
            .filter_map(|i| self.get(i))
            .chain([last])
            .map(|entry| Self::offsets(time, cum, entry))
            .collect::<Option<VecDeque<_>>>()?;
        Some(Entries::Packed { time, cum, ring })
    }

    /// Appends an entry not older than the newest.
    fn push(&mut self, entry: (u64, u64)) {
        match self {
            Entries::Empty => *self = Entries::One(entry.0, entry.1),
            Entries::Packed { time, cum, ring } => match Self::offsets(*time, *cum, entry) {
                Some(offsets) => ring.push_back(offsets),
                None => self.repack(entry),
            },
            Entries::Wide(ring) => ring.push_back(entry),
            Entries::One(..) => self.repack(entry),
        }
    }

    /// Appends `last`, packed again from the front entry if it fits so,
    /// else with every entry widened.
    fn repack(&mut self, last: (u64, u64)) {
        *self = self.packed(last).unwrap_or_else(|| {
            let mut ring: VecDeque<_> = (0..self.len()).filter_map(|i| self.get(i)).collect();
            ring.push_back(last);
            Entries::Wide(ring)
        });
    }

    /// Drops the first `k < len` entries.
    fn drain_front(&mut self, k: usize) {
        match self {
            Entries::Packed { ring, .. } => drop(ring.drain(..k)),
            Entries::Wide(ring) => drop(ring.drain(..k)),
            Entries::Empty | Entries::One(..) => {}
        }
    }

    /// Lowers the cumulative cost of every entry from `i` on by `take`, no
    /// more than entry `i` holds.
    fn lower_from(&mut self, i: usize, take: u64) {
        match self {
            Entries::One(_, c) => *c = c.wrapping_sub(take),
            // From the front: the base moves, the offsets stay.
            Entries::Packed { cum, .. } if i == 0 => *cum = cum.wrapping_sub(take),
            // Entry `i` holds `take`, so no offset from `i` on goes below
            // the one before `i`.
            Entries::Packed { ring, .. } => {
                for entry in ring.range_mut(i..) {
                    entry.1 -= take as u32;
                }
            }
            Entries::Wide(ring) => {
                for entry in ring.range_mut(i..) {
                    entry.1 = entry.1.wrapping_sub(take);
                }
            }
            Entries::Empty => {}
        }
    }
}

/// A refund rewrites the cumulative costs of the entries after its charge;
/// it reaches back at most this many entries, so its work is bounded (a
/// refund further back gives nothing back, which never over-admits).
pub(crate) const REFUND_REACH: usize = 1024;

#[cfg(test)]
thread_local! {
    /// Entries read or written by the log in this thread (tests only).
    static TOUCHED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

#[inline]
fn touch(_n: usize) {
    #[cfg(test)]
    TOUCHED.with(|c| c.set(c.get().saturating_add(_n as u64)));
}

/// Entry `i`, which exists.
#[inline]
fn read(entries: &Entries, i: usize) -> (u64, u64) {
    touch(1);
    entries.get(i).unwrap_or((u64::MAX, u64::MAX))
}

/// The first index in `lo..len` where `pred` holds, for a `pred` that is
/// false and then true along the log; `len` if none. Gallops from `lo`
/// (indices `lo`, `lo + 1`, `lo + 3`, `lo + 7`, ...), then halves the last
/// gap: `O(log d)` reads for an answer `d` entries after `lo`.
fn search(entries: &Entries, lo: usize, pred: impl Fn((u64, u64)) -> bool) -> usize {
    let len = entries.len();
    let (mut low, mut high, mut step) = (lo, lo, 1usize);
    while high < len {
        if pred(read(entries, high)) {
            break;
        }
        low = high + 1;
        high = high.saturating_add(step);
        step = step.saturating_mul(2);
    }
    let mut high = high.min(len);
    while low < high {
        let mid = low + (high - low) / 2;
        if pred(read(entries, mid)) {
            high = mid;
        } else {
            low = mid + 1;
        }
    }
    low
}

impl SlidingLogState {
    #[cfg(test)]
    /// Number of entries held (including entries refunded to nothing).
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    #[cfg(test)]
    /// Cost held by the log (as of its last decision).
    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    fn len_u64(&self) -> u64 {
        u64::try_from(self.entries.len()).unwrap_or(u64::MAX)
    }

    /// Sequence number of the next entry (of an empty log: at least this).
    fn next_seq(&self) -> u64 {
        self.front_seq.saturating_add(self.len_u64())
    }

    /// Cumulative cost through the newest entry (reads it).
    fn cum(&self) -> u64 {
        match self.entries.len().checked_sub(1) {
            Some(i) => read(&self.entries, i).1,
            None => 0,
        }
    }

    /// Cumulative cost before the front entry (reads the newest).
    fn base(&self) -> u64 {
        self.cum().wrapping_sub(self.total)
    }

    /// Removes every entry, keeping the numbering.
    fn clear(&mut self) {
        self.front_seq = self.next_seq();
        self.entries = Entries::Empty;
        self.total = 0;
        self.oldest = 0;
        self.newest = 0;
    }

    /// Removes the first `k` entries, then the entries holding no cost that
    /// follow them: `O(log)` of what it removes.
    fn pop_front(&mut self, k: usize) {
        let base = match k.checked_sub(1) {
            Some(i) => read(&self.entries, i).1,
            None => self.base(),
        };
        let first = search(&self.entries, k, |(_, c)| c != base);
        if first >= self.entries.len() {
            self.clear();
            return;
        }
        self.entries.drain_front(first);
        self.front_seq = self
            .front_seq
            .saturating_add(u64::try_from(first).unwrap_or(u64::MAX));
        self.oldest = read(&self.entries, 0).0;
        self.total = self.cum().wrapping_sub(base);
    }

    /// Appends an entry of `cost >= 1` at `now` (not before the newest);
    /// returns its sequence number.
    fn push(&mut self, now: u64, cost: u64) -> u64 {
        if self.entries.is_empty() {
            // Numbered from the time, not from an earlier life: the Redis
            // store forgets an empty log, and both must number alike.
            self.front_seq = now.min(SEQ_START_MAX);
            self.oldest = now;
        }
        let seq = self.next_seq();
        let cum = self.cum().wrapping_add(cost);
        touch(1);
        self.entries.push((now, cum));
        self.total = self.total.saturating_add(cost);
        self.newest = now;
        seq
    }
}

impl SlidingLog {
    /// The largest limit: the log keeps one entry per admission, so this
    /// bounds a key's entries.
    pub(crate) const MAX_LIMIT: u64 = 1_000_000;

    /// A log admitting at most `limit` cost in every window of
    /// `window_micros` µs. Both must be at least 1, and `limit` at most
    /// [`MAX_LIMIT`](Self::MAX_LIMIT).
    pub(crate) fn new(limit: u64, window_micros: u64) -> Result<Self, ConfigError> {
        if limit == 0 {
            return Err(ConfigError::new("limit", "must be at least 1"));
        }
        if limit > Self::MAX_LIMIT {
            return Err(ConfigError::new(
                "limit",
                "must be at most 1,000,000: a sliding log keeps one entry per admission",
            ));
        }
        if window_micros == 0 {
            return Err(ConfigError::new("window", "must be at least 1 µs"));
        }
        Ok(SlidingLog {
            limit,
            window: window_micros,
        })
    }

    /// Most cost admitted in any window.
    pub(crate) fn limit(&self) -> u64 {
        self.limit
    }

    /// Window length in µs.
    pub(crate) fn window_micros(&self) -> u64 {
        self.window
    }

    /// The same window with the limit divided by `divisor`, at least 1.
    pub(crate) fn share(&self, divisor: u64) -> SlidingLog {
        SlidingLog {
            limit: (self.limit / divisor.max(1)).max(1),
            window: self.window,
        }
    }

    /// The numbers `sliding_log.lua`'s `load` receives: limit, window (µs), 0.
    #[cfg(feature = "redis")]
    pub(crate) fn script_args(&self) -> [u64; 3] {
        [self.limit, self.window, 0]
    }

    /// `Err` when the Lua script could not decide this policy exactly in
    /// doubles: the window must be at most 2^50 (the limit, at most
    /// [`MAX_LIMIT`](Self::MAX_LIMIT), always is).
    #[cfg(feature = "redis")]
    pub(crate) fn lua_exact(&self) -> Result<(), ConfigError> {
        if self.window > LUA_MAX {
            return Err(ConfigError::new(
                "window",
                "must be at most 2^50 µs for the redis store",
            ));
        }
        Ok(())
    }

    /// Drops the entries at or before `now - W`; returns the time the log
    /// acts at (never before its newest entry).
    #[inline]
    fn trim(&self, state: &mut SlidingLogState, now: u64) -> u64 {
        let now = now.max(state.newest);
        if state.total == 0 || state.oldest.saturating_add(self.window) > now {
            return now;
        }
        let window = self.window;
        let stay = search(&state.entries, 0, |(t, _)| t.saturating_add(window) > now);
        state.pop_front(stay);
        now
    }

    fn reset(&self, state: &SlidingLogState, now: u64) -> u64 {
        if state.entries.is_empty() {
            0
        } else {
            state.newest.saturating_add(self.window).saturating_sub(now)
        }
    }

    /// Cleanup, then decides; records nothing.
    #[inline]
    pub(crate) fn check(&self, state: &mut SlidingLogState, now: u64, cost: u64) -> Decision {
        let now = self.trim(state, now);
        let remaining = self.limit.saturating_sub(state.total);
        let reset = self.reset(state, now);
        if cost > self.limit {
            return never(self.limit, remaining, reset);
        }
        if cost <= remaining {
            let reset = if cost > 0 { self.window } else { reset };
            return Decision {
                admitted: true,
                limit: self.limit,
                remaining: remaining - cost,
                retry_after: None,
                reset: micros(reset),
            };
        }
        // Wait until the oldest entries holding `to_free` have left the
        // window: 1 <= to_free <= total, as total + cost > limit >= cost.
        let to_free = state.total.saturating_sub(self.limit - cost);
        let leaves = if to_free <= 1 {
            state.oldest
        } else {
            let base = state.base();
            let i = search(&state.entries, 0, |(_, c)| c.wrapping_sub(base) >= to_free);
            read(&state.entries, i).0.min(state.newest)
        };
        let wait = leaves
            .saturating_add(self.window)
            .saturating_sub(now)
            .max(1);
        Decision {
            admitted: false,
            limit: self.limit,
            remaining,
            retry_after: Some(micros(wait)),
            reset: micros(reset),
        }
    }

    /// Records an admission that [`check`](Self::check) just admitted at the
    /// same `now`. The hold names the entry; nothing recorded (cost 0) is
    /// `Hold::default()`.
    #[inline]
    pub(crate) fn record(&self, state: &mut SlidingLogState, now: u64, cost: u64) -> Hold {
        let now = self.trim(state, now);
        let cost = cost.min(self.limit.saturating_sub(state.total));
        if cost == 0 {
            return Hold::default();
        }
        // The entry's number and time name it: a later life of the key can
        // reuse a number, never at the same time.
        Hold {
            mark: state.push(now, cost),
            frac: now,
            amount: cost,
            life: 0,
        }
    }

    /// Settles a charge: `delta > 0` charges more at `now` (a new entry,
    /// capped at what is left; the hold is returned unchanged), `delta < 0`
    /// refunds from the charge's own entry, at most `hold.amount` and what
    /// the entry still holds, nothing once it has left the window or once
    /// more than [`REFUND_REACH`] entries have been admitted after it. Work:
    /// one write per entry admitted after the charge, so at most that many.
    pub(crate) fn settle(
        &self,
        state: &mut SlidingLogState,
        now: u64,
        hold: Hold,
        delta: i64,
    ) -> Hold {
        // Read, not trimmed: since the charge, a redeploy may have decided
        // the log under a longer window, whose entries a trim to this one
        // would drop. The entries this window no longer holds leave no room
        // and give nothing back; the next decision trims them.
        let now = now.max(state.newest);
        let window = self.window;
        let stay = if state.total == 0 || state.oldest.saturating_add(window) > now {
            0
        } else {
            search(&state.entries, 0, |(t, _)| t.saturating_add(window) > now)
        };
        if delta > 0 {
            let before = match stay.checked_sub(1) {
                Some(p) => read(&state.entries, p).1,
                None => state.base(),
            };
            let held = state.cum().wrapping_sub(before);
            let add = delta.unsigned_abs().min(self.limit.saturating_sub(held));
            if add > 0 {
                state.push(now, add);
            }
            return hold;
        }
        let want = delta.unsigned_abs().min(hold.amount);
        let index = hold
            .mark
            .checked_sub(state.front_seq)
            .and_then(|i| usize::try_from(i).ok())
            .filter(|&i| stay <= i && i < state.entries.len());
        let (Some(i), true) = (index, want > 0) else {
            return hold;
        };
        if state.entries.len() - i > REFUND_REACH {
            // Too far back to rewrite in bounded work: nothing is given back.
            return hold;
        }
        let (time, cum) = read(&state.entries, i);
        if time != hold.frac {
            // Another entry under the same number: the charge's has gone.
            return hold;
        }
        let before = match i.checked_sub(1) {
            Some(p) => read(&state.entries, p).1,
            None => state.base(),
        };
        let held = cum.wrapping_sub(before);
        let take = want.min(held);
        if take == 0 {
            return hold;
        }
        touch(state.entries.len() - i);
        state.entries.lower_from(i, take);
        state.total = state.total.saturating_sub(take);
        if i == 0 && take == held {
            state.pop_front(1);
        }
        Hold {
            amount: hold.amount - take,
            ..hold
        }
    }

    /// From this time the state is equivalent to fresh: the newest entry
    /// has left the window.
    #[inline]
    pub(crate) fn fresh_at(&self, state: &SlidingLogState) -> u64 {
        if state.entries.is_empty() {
            0
        } else {
            state.newest.saturating_add(self.window)
        }
    }
}

#[cfg(test)]
mod tests;
