//! [`GrantTable`]: the grants of one budget as the script counts them.

use redis::Value;

use super::Rate;
use crate::clock::Timestamp;

/// The grants of one budget as the script counts them, read by
/// [`LeaseStore::grants`](super::LeaseStore::grants).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) struct GrantTable {
    /// The script's time (Redis time, µs).
    pub now: Timestamp,
    /// Every live instance.
    pub instances: Vec<InstanceGrant>,
}

/// One instance's entry in a [`GrantTable`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) struct InstanceGrant {
    /// The instance id.
    pub id: String,
    /// The demand it last reported.
    pub demand: Rate,
    /// Whether that demand was a guess (its first refresh, nothing measured
    /// yet) or held back by its grant (once, or twice in a row). Others'
    /// targets count a guess as the whole budget, a demand held back once
    /// as half itself, and one held back twice in a row as twice itself, at
    /// most that, unless they are held back twice in a row too.
    pub guessed: bool,
    /// The grants it may still be spending, by expiry, rates decreasing; the
    /// last one is its latest grant.
    pub steps: Vec<GrantStep>,
}

/// A grant counted until its expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) struct GrantStep {
    /// The granted rate.
    pub rate: Rate,
    /// Its expiry on Redis time.
    pub expires_at: Timestamp,
}

impl InstanceGrant {
    /// The rate counted for this instance at Redis time `t`: the highest
    /// rate among its steps that expire after `t`.
    pub(crate) fn committed_at(&self, t: Timestamp) -> Rate {
        self.steps
            .iter()
            .filter(|s| s.expires_at > t)
            .map(|s| s.rate)
            .max()
            .unwrap_or(Rate::ZERO)
    }

    #[cfg(test)]
    /// Its latest grant.
    pub(crate) fn latest(&self) -> Option<GrantStep> {
        self.steps.last().copied()
    }
}

impl GrantTable {
    /// The sum of all instances' commitments at Redis time `t`.
    pub(crate) fn committed_at(&self, t: Timestamp) -> Rate {
        Rate(self.instances.iter().map(|i| i.committed_at(t).0).sum())
    }

    /// The highest sum of commitments at any time from [`now`](Self::now)
    /// on, checked at `now` and at every step's expiry.
    pub(crate) fn peak(&self) -> Rate {
        let times = std::iter::once(self.now).chain(
            self.instances
                .iter()
                .flat_map(|i| i.steps.iter().map(|s| s.expires_at)),
        );
        times
            .filter(|t| *t >= self.now)
            .map(|t| self.committed_at(t))
            .max()
            .unwrap_or(Rate::ZERO)
    }

    #[cfg(test)]
    /// The entry of instance `id`.
    pub(crate) fn instance(&self, id: &str) -> Option<&InstanceGrant> {
        self.instances.iter().find(|i| i.id == id)
    }
}

pub(super) fn parse_table(v: &Value) -> Option<GrantTable> {
    let Value::Array(items) = v else {
        return None;
    };
    let int = |i: usize| match items.get(i)? {
        Value::Int(n) => u64::try_from(*n).ok(),
        _ => None,
    };
    let now = int(0)?;
    let n = int(1)?;
    let mut at = 2;
    let mut instances = Vec::new();
    for _ in 0..n {
        let id = match items.get(at)? {
            Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
            Value::SimpleString(s) => s.clone(),
            _ => return None,
        };
        let demand = int(at + 1)?;
        let guessed = int(at + 2)? != 0;
        let count = int(at + 3)?;
        at += 4;
        let mut steps = Vec::new();
        for _ in 0..count {
            steps.push(GrantStep {
                rate: Rate(int(at)?),
                expires_at: Timestamp(int(at + 1)?),
            });
            at += 2;
        }
        instances.push(InstanceGrant {
            id,
            demand: Rate(demand),
            guessed,
            steps,
        });
    }
    Some(GrantTable {
        now: Timestamp(now),
        instances,
    })
}
