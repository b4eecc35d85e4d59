//! Reading the allocations: one region's, all of them, and a consistent
//! [`Snapshot`] of every region.

use std::collections::HashMap;

use futures_util::future::join_all;

use super::ledger::RegionState;
use super::region::Unreachable;
use super::{RegionError, RegionalBudget};
use crate::redis::Request;

/// How many times [`RegionalBudget::snapshot`] reads before giving up.
pub(super) const SNAPSHOT_ATTEMPTS: u32 = 64;

impl RegionalBudget {
    /// Reads one region's allocation.
    ///
    /// ```no_run
    /// # use tower_admission::outbound::RegionalBudget;
    /// # async fn run(budget: RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let eu = budget.allocation("eu").await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn allocation(&self, region: &str) -> Result<u64, RegionError> {
        let r = self.known_region(region)?;
        self.read_allocation(r).await
    }

    /// Reads every region's allocation, each region separately, in the
    /// order the regions were added.
    ///
    /// The reads are not one moment: while transfers run, their sum can be
    /// below the total (an amount in flight, or a transfer seen at neither
    /// end) **or above it** (a transfer completed between the read of its
    /// donor and the read of its receiver counts at both ends). The
    /// invariant, sum ≤ total, is about moments; check it with
    /// [`snapshot`](Self::snapshot).
    ///
    /// ```no_run
    /// # use tower_admission::outbound::RegionalBudget;
    /// # async fn run(budget: RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// for (region, allocation) in budget.allocations().await? {
    ///     println!("{region}: {allocation}");
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn allocations(&self) -> Result<Vec<(String, u64)>, RegionError> {
        let reads = join_all(self.inner.regions.iter().map(|r| self.read_allocation(r))).await;
        self.inner
            .regions
            .iter()
            .zip(reads)
            .map(|(r, read)| read.map(|a| (r.name.to_string(), a)))
            .collect()
    }

    /// A consistent cut of all regions: allocations and the amount in
    /// flight, in a state the regions could have been in together.
    ///
    /// Every region's state is read at once, each with one atomic
    /// `HGETALL`. The reads form a consistent cut when every credit they
    /// contain has its debit in them too; the scripts number each debit
    /// (`seq`) and each receiver keeps the highest number it credited from
    /// each donor, so that is checked exactly. A cut that is not consistent
    /// (a whole transfer ran between two of the reads) is read again, up to
    /// 64 times, then [`RegionError::NotConsistent`]. A consistent cut
    /// above the total (regions seeded under different splits) is
    /// [`RegionError::AboveTotal`], so in the result `sum() <= total()`
    /// and, unless a region was recovered after a state loss,
    /// `sum() + in_flight() == total()`.
    ///
    /// ```no_run
    /// # use tower_admission::outbound::RegionalBudget;
    /// # async fn run(budget: RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let snapshot = budget.snapshot().await?;
    /// assert!(snapshot.sum() <= budget.total());
    /// println!("{} in flight", snapshot.in_flight());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn snapshot(&self) -> Result<Snapshot, RegionError> {
        for _ in 0..SNAPSHOT_ATTEMPTS {
            let states = self.read_states().await?;
            let missing: Vec<String> = self
                .inner
                .regions
                .iter()
                .zip(&states)
                .filter(|(_, s)| s.is_none())
                .map(|(r, _)| r.name.to_string())
                .collect();
            if !missing.is_empty() {
                return Err(RegionError::StateLost {
                    regions: missing,
                    debited: false,
                });
            }
            let states: Vec<RegionState> = states.into_iter().flatten().collect();
            if self.is_consistent(&states) {
                self.check_at_most_total(states.iter().map(|s| s.allocation))?;
                return Ok(Snapshot {
                    total: self.inner.total,
                    regions: self
                        .inner
                        .regions
                        .iter()
                        .zip(states)
                        .map(|(r, s)| (r.name.to_string(), s.allocation, s.debited, s.credited))
                        .collect(),
                });
            }
        }
        Err(RegionError::NotConsistent {
            attempts: SNAPSHOT_ATTEMPTS,
        })
    }

    /// Every region's state hash at once; `None` for a missing one.
    pub(super) async fn read_states(&self) -> Result<Vec<Option<RegionState>>, RegionError> {
        let reads = join_all(self.inner.regions.iter().map(|region| async move {
            let mut cmd = redis::cmd("HGETALL");
            cmd.arg(&region.state_key);
            let reply = self
                .call(region, Request::Cmd(&cmd))
                .await
                .map_err(|e| e.into_region(region))?;
            let map: HashMap<String, String> =
                redis::from_redis_value(reply).map_err(|e| RegionError::Malformed {
                    region: region.name.to_string(),
                    message: e.to_string(),
                })?;
            let state = RegionState::parse(&map).map_err(|message| RegionError::Malformed {
                region: region.name.to_string(),
                message,
            })?;
            region.remember_epoch(state.as_ref().map(|s| s.epoch.as_str()));
            Ok(state)
        }))
        .await;
        reads.into_iter().collect()
    }

    /// True if every credit in `states` has its debit in `states` too.
    pub(super) fn is_consistent(&self, states: &[RegionState]) -> bool {
        states.iter().all(|receiver| {
            receiver.seen.iter().all(|(donor, epoch, seq)| {
                match self.inner.regions.iter().position(|r| &*r.name == donor) {
                    // A credit from the donor's current life must not be
                    // ahead of the donor's own count of debits. Credits from
                    // an earlier life (before a recovery) or from a region no
                    // longer configured cannot be checked.
                    Some(i) => states[i].epoch != *epoch || *seq <= states[i].seq,
                    None => true,
                }
            })
        })
    }
}

/// A consistent cut of a [`RegionalBudget`], from
/// [`RegionalBudget::snapshot`]: the allocations and the amount in flight,
/// read so that every credit in it has its debit in it too. It is a state
/// the regions could have been in together (money only moves by a debit
/// followed by its credit), which is what the invariant is about.
///
/// ```no_run
/// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
/// let s = budget.snapshot().await?;
/// assert!(s.sum() <= s.total());
/// assert_eq!(s.sum() + s.in_flight(), s.total()); // no region was recovered
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    total: u64,
    /// (region, allocation, debited total, credited total)
    regions: Vec<(String, u64, u64, u64)>,
}

impl Snapshot {
    /// The budget's total.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// assert_eq!(budget.snapshot().await?.total(), budget.total());
    /// # Ok(())
    /// # }
    /// ```
    pub fn total(&self) -> u64 {
        self.total
    }

    /// One region's allocation; `None` for a region not in the budget.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let eu = budget.snapshot().await?.allocation("eu");
    /// # Ok(())
    /// # }
    /// ```
    pub fn allocation(&self, region: &str) -> Option<u64> {
        self.regions.iter().find(|r| r.0 == region).map(|r| r.1)
    }

    /// Every region's allocation, in the order the regions were added.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// for (region, allocation) in budget.snapshot().await?.allocations() {
    ///     println!("{region}: {allocation}");
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn allocations(&self) -> impl Iterator<Item = (&str, u64)> + '_ {
        self.regions.iter().map(|r| (r.0.as_str(), r.1))
    }

    /// The sum of the allocations; at most the total.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// assert!(budget.snapshot().await?.sum() <= budget.total());
    /// # Ok(())
    /// # }
    /// ```
    pub fn sum(&self) -> u64 {
        self.regions.iter().map(|r| r.1).sum()
    }

    /// Everything ever debited, over all regions (since each was seeded).
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let s = budget.snapshot().await?;
    /// assert!(s.credited() <= s.debited());
    /// # Ok(())
    /// # }
    /// ```
    pub fn debited(&self) -> u64 {
        self.regions.iter().map(|r| r.2).sum()
    }

    /// Everything ever credited, over all regions; never more than
    /// [`debited`](Self::debited), since every credit follows its debit.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let s = budget.snapshot().await?;
    /// assert!(s.credited() <= s.debited());
    /// # Ok(())
    /// # }
    /// ```
    pub fn credited(&self) -> u64 {
        self.regions.iter().map(|r| r.3).sum()
    }

    /// The amount debited but not yet credited at that moment:
    /// `debited() - credited()`.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// println!("{} in flight", budget.snapshot().await?.in_flight());
    /// # Ok(())
    /// # }
    /// ```
    pub fn in_flight(&self) -> u64 {
        self.debited().saturating_sub(self.credited())
    }
}
