//! What the regions' scripts store and answer: a debit's record, a region's
//! state hash, and the replies read from them.

use std::collections::HashMap;

use redis::Value;

/// A debit as recorded by the donor.
#[derive(Debug, Clone)]
pub(super) struct Record {
    pub(super) amount: u64,
    pub(super) to: String,
    pub(super) seq: u64,
    /// The donor's epoch when it debited.
    pub(super) epoch: String,
    /// The receiver's epoch the transfer was started against.
    pub(super) to_epoch: String,
    /// Given back by `regions_refund.lua`.
    pub(super) refunded: bool,
}

impl Record {
    /// `amount:to:seq:epoch:to_epoch`, with `:refunded` once given back.
    pub(super) fn parse(s: &str) -> Option<Record> {
        let mut parts = s.split(':');
        let record = Record {
            amount: parts.next()?.parse().ok()?,
            to: parts.next()?.to_owned(),
            seq: parts.next()?.parse().ok()?,
            epoch: parts.next()?.to_owned(),
            to_epoch: parts.next()?.to_owned(),
            refunded: match parts.next() {
                None => false,
                Some("refunded") => true,
                Some(_) => return None,
            },
        };
        parts.next().is_none().then_some(record)
    }

    /// The record as `regions_debit.lua` wrote it (before any refund).
    pub(super) fn as_written(&self) -> String {
        let Record {
            amount,
            to,
            seq,
            epoch,
            to_epoch,
            ..
        } = self;
        format!("{amount}:{to}:{seq}:{epoch}:{to_epoch}")
    }
}

/// What the credit step found on the receiver.
pub(super) enum Credit {
    /// Credited by this call.
    Now,
    /// Credited before; nothing changed.
    Before,
    /// The receiver holds a credit under this id from an earlier state of
    /// the donor, of this amount; the debit was given back.
    Refunded { credited_earlier: u64 },
}

pub(super) enum DebitReply {
    Now {
        seq: u64,
        epoch: String,
    },
    Before(Record),
    Refused {
        available: u64,
    },
    Missing,
    /// Not debited before, and no receiver epoch was given.
    EpochNeeded,
}

pub(super) fn parse_debit(reply: Value) -> Option<DebitReply> {
    let Value::Array(items) = reply else {
        return None;
    };
    let unsigned = |v: &Value| int(v).and_then(|i| u64::try_from(i).ok());
    match int(items.first()?)? {
        1 => Some(DebitReply::Now {
            seq: unsigned(items.get(1)?)?,
            epoch: text(items.get(2)?)?,
        }),
        2 => Some(DebitReply::Before(Record {
            amount: unsigned(items.get(1)?)?,
            seq: unsigned(items.get(2)?)?,
            epoch: text(items.get(3)?)?,
            to: text(items.get(4)?)?,
            to_epoch: text(items.get(5)?)?,
            refunded: unsigned(items.get(6)?)? == 1,
        })),
        0 => Some(DebitReply::Refused {
            available: unsigned(items.get(1)?)?,
        }),
        -1 => Some(DebitReply::Missing),
        -2 => Some(DebitReply::EpochNeeded),
        _ => None,
    }
}

pub(super) fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

pub(super) fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

/// A region's state hash, parsed.
pub(super) struct RegionState {
    pub(super) allocation: u64,
    pub(super) debited: u64,
    pub(super) credited: u64,
    pub(super) seq: u64,
    pub(super) epoch: String,
    /// (donor, donor epoch, highest seq credited from it)
    pub(super) seen: Vec<(String, String, u64)>,
}

impl RegionState {
    pub(super) fn parse(map: &HashMap<String, String>) -> Result<Option<RegionState>, String> {
        let Some(alloc) = map.get("alloc") else {
            return Ok(None);
        };
        let number = |field: &str, v: Option<&String>| -> Result<u64, String> {
            v.map_or(Ok(0), |v| v.parse())
                .map_err(|_| format!("field `{field}` is not a non-negative integer"))
        };
        let mut seen = Vec::new();
        for (field, value) in map {
            if let Some(donor) = field.strip_prefix("from:") {
                let (epoch, seq) = value
                    .split_once(':')
                    .ok_or_else(|| format!("field `{field}` is unreadable"))?;
                let seq = seq
                    .parse()
                    .map_err(|_| format!("field `{field}` is unreadable"))?;
                seen.push((donor.to_owned(), epoch.to_owned(), seq));
            }
        }
        Ok(Some(RegionState {
            allocation: number("alloc", Some(alloc))?,
            debited: number("debited", map.get("debited"))?,
            credited: number("credited", map.get("credited"))?,
            seq: number("seq", map.get("seq"))?,
            epoch: map.get("epoch").cloned().unwrap_or_default(),
            seen,
        }))
    }
}
