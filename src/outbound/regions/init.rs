//! Seeding the regions' states, and recovering one that lost its data.

use super::ledger::int;
use super::region::{Region, Unreachable};
use super::{RegionError, RegionalBudget};
use crate::redis::Request;

impl RegionalBudget {
    /// Seeds every region with its initial allocation, if needed; safe to
    /// call from every process at start. Returns true if it seeded at least
    /// one region now, false if every region already had its state (nothing
    /// changed).
    ///
    /// Regions that already hold state are never changed. Missing regions
    /// are seeded only while every existing region is untouched since it
    /// was seeded (no debit, no credit), which is the case during a first
    /// start, even with several processes initializing at once. If a region
    /// is missing after transfers have run, its data was lost: re-seeding it
    /// at its initial share could raise the sum above the total, so this
    /// returns [`RegionError::StateLost`] and changes nothing; see
    /// [`recover_lost`](Self::recover_lost).
    ///
    /// Seeding never raises the sum above the total: when the surviving
    /// allocations plus the missing regions' initial shares exceed it (a
    /// region added to a budget whose surviving regions still hold the old
    /// split), this returns [`RegionError::AboveTotal`] and changes nothing.
    /// Create such a region at 0 with [`recover_lost`](Self::recover_lost)
    /// and [`transfer`](Self::transfer) allocation to it. The check reads the
    /// surviving regions in the same reads that find the missing ones, so
    /// processes initializing at once must share one split.
    ///
    /// A missing region next to surviving ones may have lost a debit whose
    /// credit is still on the way. Before seeding it, each surviving region is
    /// pinned, atomically with its untouched check, to take credits from the
    /// new state only (a late credit fails with
    /// [`RegionError::DonorReseeded`](super::RegionError::DonorReseeded)).
    /// When another process seeded the region first, the pins move to its
    /// state; a transfer from it that runs before they have moved is refused
    /// the same way.
    ///
    /// ```no_run
    /// # use tower_admission::outbound::RegionalBudget;
    /// # async fn run(budget: RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// if budget.initialize().await? {
    ///     println!("first start");
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn initialize(&self) -> Result<bool, RegionError> {
        let states = self.read_states().await?;
        let missing: Vec<&Region> = self
            .inner
            .regions
            .iter()
            .zip(&states)
            .filter(|(_, s)| s.is_none())
            .map(|(r, _)| r)
            .collect();
        if missing.is_empty() {
            return Ok(false);
        }
        let touched = states
            .iter()
            .flatten()
            .any(|s| s.debited > 0 || s.credited > 0);
        if touched {
            return Err(RegionError::StateLost {
                regions: missing.iter().map(|r| r.name.to_string()).collect(),
                debited: false,
            });
        }
        let surviving = states.iter().flatten().map(|s| s.allocation);
        self.check_at_most_total(surviving.chain(missing.iter().map(|r| r.initial)))?;
        let survivors: Vec<&Region> = self
            .inner
            .regions
            .iter()
            .zip(&states)
            .filter(|(_, s)| s.is_some())
            .map(|(r, _)| r)
            .collect();
        for region in missing {
            // A lost state of `region` may have debited a credit still on
            // the way: before its share is back, the survivors take credits
            // from the new state only, while still untouched.
            let epoch = fresh_epoch();
            for survivor in &survivors {
                let lost = match self.pin(survivor, region, &epoch, Pin::Untouched).await? {
                    1 => continue,
                    -1 => survivor,
                    _ => region,
                };
                return Err(RegionError::StateLost {
                    regions: vec![lost.name.to_string()],
                    debited: false,
                });
            }
            if !self.seed(region, region.initial, &epoch).await? {
                // Seeded at once by another process, after this one found it
                // missing: its state is a new one too.
                let live = self.live_epoch(region).await?;
                for survivor in &survivors {
                    self.pin(survivor, region, &live, Pin::Always).await?;
                }
            }
        }
        Ok(true)
    }

    /// Re-creates a region whose state is missing (lost, or added to a
    /// running budget) with allocation **0**; returns false (and changes
    /// nothing) if the region has state.
    ///
    /// This is the safe recovery after a region's Redis lost its data: the
    /// other regions plus the amounts in flight hold at most the total, so a
    /// region at 0 keeps the sum at most the total. The share the region held
    /// is not restored. Transfers to and from it work again at once. The new
    /// state has a new epoch: transfers to it debited before the recovery are
    /// never credited to it, and [`repair`](Self::repair),
    /// [`repair_all`](Self::repair_all) and retries report them as
    /// [`RegionError::ReceiverRecreated`](super::RegionError::ReceiverRecreated),
    /// their amounts lost from the sum. Debits it had made are forgotten with
    /// its data (a retry of one is given back, see [`RegionalBudget`]). After a
    /// recovery the identity `sum + in_flight == total` of a
    /// [`Snapshot`](super::Snapshot) no longer holds (the lost share is missing
    /// from both), while `sum <= total` does.
    ///
    /// ```no_run
    /// # use tower_admission::outbound::{RegionError, RegionalBudget};
    /// # async fn run(budget: RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// if let Err(RegionError::StateLost { regions, .. }) = budget.initialize().await {
    ///     for region in &regions {
    ///         budget.recover_lost(region).await?;
    ///     }
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn recover_lost(&self, region: &str) -> Result<bool, RegionError> {
        let region = self.known_region(region)?;
        let created = self.seed(region, 0, &fresh_epoch()).await?;
        // Regions pinned to an earlier state of it (see `initialize`) take
        // credits from this one now; a share of 0 cannot count them twice.
        let live = self.live_epoch(region).await?;
        for other in self.inner.regions.iter().filter(|r| r.name != region.name) {
            self.pin(other, region, &live, Pin::Existing).await?;
        }
        Ok(created)
    }

    pub(super) async fn seed(
        &self,
        region: &Region,
        allocation: u64,
        epoch: &str,
    ) -> Result<bool, RegionError> {
        let mut invocation = self.inner.seed.prepare_invoke();
        invocation.key(&region.state_key).arg(allocation).arg(epoch);
        let reply = self
            .call(region, Request::Script(&invocation))
            .await
            .map_err(|e| e.into_region(region))?;
        match int(&reply) {
            Some(1) => {
                region.remember_epoch(Some(epoch));
                Ok(true)
            }
            Some(0) => Ok(false),
            _ => Err(RegionError::Malformed {
                region: region.name.to_string(),
                message: "unexpected reply to the seed script".to_owned(),
            }),
        }
    }

    /// Makes `on` take credits from `from` only from its state `epoch`
    /// (`regions_pin.lua`); replies 1 if pinned, 0 if not, -1 if `on` has
    /// no state.
    pub(super) async fn pin(
        &self,
        on: &Region,
        from: &Region,
        epoch: &str,
        when: Pin,
    ) -> Result<i64, RegionError> {
        let mut invocation = self.inner.pin.prepare_invoke();
        invocation
            .key(&on.state_key)
            .arg(&*from.name)
            .arg(epoch)
            .arg(match when {
                Pin::Untouched => "untouched",
                Pin::Existing => "existing",
                Pin::Always => "always",
            });
        let reply = self
            .call(on, Request::Script(&invocation))
            .await
            .map_err(|e| e.into_region(on))?;
        int(&reply).ok_or_else(|| RegionError::Malformed {
            region: on.name.to_string(),
            message: "unexpected reply to the pin script".to_owned(),
        })
    }
}

/// When [`RegionalBudget::pin`] writes its pin.
#[derive(Clone, Copy)]
pub(super) enum Pin {
    /// Only while the region has no debit and no credit.
    Untouched,
    /// Only in place of a pin already set.
    Existing,
    /// In any case.
    Always,
}

/// A fresh epoch, naming one life of a region's state.
pub(super) fn fresh_epoch() -> String {
    format!("{:016x}", rand::random::<u64>())
}
