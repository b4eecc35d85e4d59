//! Returning the allocation a region lost with its data, computed from a
//! consistent cut, never guessed.

use std::collections::HashMap;

use futures_util::future::join_all;
use redis::Value;

use super::init::Pin;
use super::ledger::{int, Record, RegionState};
use super::region::Unreachable;
use super::{RegionError, RegionalBudget};
use crate::redis::Request;

const RESTORE_ATTEMPTS: u32 = 8;

impl RegionalBudget {
    /// Gives `region` back what the regions lost with a state loss, after
    /// [`recover_lost`](Self::recover_lost) re-created it at 0; returns the
    /// amount (0 if nothing is missing). Safe to call at any time and more
    /// than once.
    ///
    /// The amount is exact, read from a consistent cut of every region:
    /// `total − Σ allocations − Σ in flight`, where a pair's in-flight
    /// amount is its last ordered transfer if the donor's number is above
    /// the receiver's watermark and the debit was made against the
    /// receiver's current state (one toward a lost state never lands, so it
    /// is part of the loss). First, every other region is pinned to
    /// `region`'s current state, so no credit debited by its lost state
    /// lands after the reading. The amount is credited with the
    /// [credit hold](super::RegionalBudgetBuilder::credit_hold): grants
    /// issued before the loss may still be spent until they expire.
    ///
    /// A transfer whose debit was bound to the lost state before the
    /// recovery, and which only then reaches it, is refused for good
    /// ([`RegionError::ReceiverRecreated`](super::RegionError::ReceiverRecreated))
    /// after this reading: call it again once the transfers running at the
    /// recovery are done (a rebalancing period); it returns what is still
    /// missing, or 0.
    ///
    /// Refused with [`RegionError::NotConsistent`] while an id-based
    /// [`transfer`](Self::transfer) is pending (its amount cannot be placed)
    /// or when no consistent cut was read in a few attempts.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// budget.recover_lost("ap").await?;
    /// let returned = budget.restore_lost("ap").await?;
    /// assert_eq!(budget.snapshot().await?.sum(), budget.total());
    /// # let _ = returned;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn restore_lost(&self, region: &str) -> Result<u64, RegionError> {
        let target = self.known_region(region)?;
        // From now on a region takes credits only from the current state of
        // each other: a debit made by a lost state never lands after the
        // reading below counted it as lost.
        let mut epochs = Vec::with_capacity(self.inner.regions.len());
        for region in &self.inner.regions {
            epochs.push(self.live_epoch(region).await?);
        }
        for on in &self.inner.regions {
            for (from, epoch) in self.inner.regions.iter().zip(&epochs) {
                if from.name != on.name {
                    self.pin(on, from, epoch, Pin::Always).await?;
                }
            }
        }
        for _ in 0..RESTORE_ATTEMPTS {
            let maps = self.read_raw().await?;
            let mut states = Vec::with_capacity(maps.len());
            for (region, map) in self.inner.regions.iter().zip(&maps) {
                let state = RegionState::parse(map)
                    .map_err(|message| RegionError::Malformed {
                        region: region.name.to_string(),
                        message,
                    })?
                    .ok_or_else(|| RegionError::StateLost {
                        regions: vec![region.name.to_string()],
                        debited: false,
                    })?;
                states.push(state);
            }
            if !self.is_consistent(&states) {
                continue;
            }
            let Some(in_flight) = self.ordered_in_flight(&maps, &states).await? else {
                return Err(RegionError::NotConsistent { attempts: 1 });
            };
            let held: u64 = states.iter().map(|s| s.allocation).sum();
            let lost = self
                .inner
                .total
                .saturating_sub(held)
                .saturating_sub(in_flight);
            if lost == 0 {
                return Ok(0);
            }
            let i = self
                .inner
                .regions
                .iter()
                .position(|r| r.name == target.name)
                .unwrap_or(0);
            let restores = maps[i].get("restores").map_or("0", String::as_str);
            let mut invocation = self.inner.restore.prepare_invoke();
            invocation
                .key(&target.state_key)
                .arg(&states[i].epoch)
                .arg(restores)
                .arg(lost);
            let reply = self
                .call(target, Request::Script(&invocation))
                .await
                .map_err(|e| e.into_region(target))?;
            if let Value::Array(items) = reply {
                if items.first().and_then(int) == Some(1) {
                    tracing::info!(
                        region,
                        amount = lost,
                        "restored the allocation lost with a state loss"
                    );
                    return Ok(lost);
                }
            }
        }
        Err(RegionError::NotConsistent {
            attempts: RESTORE_ATTEMPTS,
        })
    }

    /// Every region's state hash, unparsed; an empty map for a missing one.
    async fn read_raw(&self) -> Result<Vec<HashMap<String, String>>, RegionError> {
        let reads = join_all(self.inner.regions.iter().map(|region| async move {
            let mut cmd = redis::cmd("HGETALL");
            cmd.arg(&region.state_key);
            let reply = self
                .call(region, Request::Cmd(&cmd))
                .await
                .map_err(|e| e.into_region(region))?;
            redis::from_redis_value(reply).map_err(|e| RegionError::Malformed {
                region: region.name.to_string(),
                message: e.to_string(),
            })
        }))
        .await;
        reads.into_iter().collect()
    }

    /// The amount of ordered transfers debited but not yet credited between
    /// the current states in the cut; `None` if an id-based transfer is
    /// pending.
    async fn ordered_in_flight(
        &self,
        maps: &[HashMap<String, String>],
        states: &[RegionState],
    ) -> Result<Option<u64>, RegionError> {
        let pendings = join_all(self.inner.regions.iter().map(|region| async move {
            let mut cmd = redis::cmd("HKEYS");
            cmd.arg(&region.pending_key);
            let reply = self
                .call(region, Request::Cmd(&cmd))
                .await
                .map_err(|e| e.into_region(region))?;
            let keys: Vec<String> = redis::from_redis_value(reply).unwrap_or_default();
            Ok::<_, RegionError>(keys.iter().any(|k| !k.starts_with('~')))
        }))
        .await;
        for id_based in pendings {
            if id_based? {
                return Ok(None);
            }
        }
        let mut in_flight = 0;
        for (d, donor) in self.inner.regions.iter().enumerate() {
            for (s, receiver) in self.inner.regions.iter().enumerate() {
                if d == s {
                    continue;
                }
                let number = |map: &HashMap<String, String>, field: &str| -> u64 {
                    map.get(field).and_then(|v| v.parse().ok()).unwrap_or(0)
                };
                let out = number(&maps[d], &format!("out:{}", receiver.name));
                let mark = format!("in:{}:{}", donor.name, states[d].epoch);
                if out <= number(&maps[s], &mark) {
                    continue;
                }
                let last = maps[d]
                    .get(&format!("last:{}", receiver.name))
                    .and_then(|r| Record::parse(r));
                if let Some(record) = last {
                    if record.to_epoch == states[s].epoch {
                        in_flight += record.amount;
                    }
                }
            }
        }
        Ok(Some(in_flight))
    }
}
