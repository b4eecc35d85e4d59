//! [`Rebalancer`]: moves one region's surplus toward the regions whose
//! leases are held back, by ordered transfers.

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use super::{RegionError, RegionalBudget};
use crate::outbound::{LeaseStore, Rate};
use crate::redis::Request;
use crate::ConfigError;

/// Redistribution by demand, run for one donor region (feature `redis`).
///
/// Each region runs its own rebalancer (every instance may run one; a
/// per-region role lease picks one at a time, see
/// [`spawn`](Self::spawn)), and it only ever gives away its own region's
/// surplus: no region depends on another's rebalancer to spend what it
/// holds, and a dead region's rebalancer stops only that region's gifts.
///
/// # The rule, every period
///
/// 1. Finish this region's unconfirmed transfers
///    ([`RegionalBudget::repair_all`]).
/// 2. Read every region's demand: the sum of what its instances' leases
///    reported (a held-back instance reports at least twice its grant, so
///    a region whose callers wait shows the need), and this region's
///    spendable allocation.
/// 3. Fair targets: the total split in proportion to demand (all regions at
///    their current allocation while no demand is known).
/// 4. This region's surplus is `spendable − max(target, demand, floor)`
///    (the floor from [`keep_at_least`](Self::keep_at_least)); a
///    receiver's need is `target − allocation`. If both exceed the dead
///    band, send `min(surplus, need, max_step)` to the neediest reachable
///    receiver. A receiver whose demand could not be read (its Redis down)
///    or whose last transfer is unconfirmed gets nothing this period: no
///    transfer is sent into a region that cannot confirm one, so an outage
///    strands at most one `max_step` per pair.
#[derive(Clone)]
pub struct Rebalancer {
    budget: RegionalBudget,
    region: String,
    stores: Vec<(String, LeaseStore)>,
    max_step: u64,
    dead_band: u64,
    floor: u64,
}

impl fmt::Debug for Rebalancer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rebalancer")
            .field("region", &self.region)
            .field("max_step", &self.max_step)
            .field("dead_band", &self.dead_band)
            .field("floor", &self.floor)
            .finish()
    }
}

impl Rebalancer {
    /// A rebalancer giving from `region`, reading each region's demand from
    /// its lease store (`stores`: region name and the store its
    /// [`RegionLease`](super::RegionLease)s lease from), moving at most
    /// `max_step` per period, and nothing below `dead_band`.
    pub fn new(
        budget: RegionalBudget,
        region: &str,
        stores: Vec<(String, LeaseStore)>,
        max_step: u64,
        dead_band: u64,
    ) -> Result<Self, ConfigError> {
        if budget.regions().all(|(name, _)| name != region) {
            return Err(ConfigError::new(
                "region",
                format!("`{region}` is not a region of the budget"),
            ));
        }
        if let Some((name, _)) = stores
            .iter()
            .find(|(name, _)| budget.regions().all(|(r, _)| r != name))
        {
            return Err(ConfigError::new(
                "stores",
                format!("`{name}` is not a region of the budget"),
            ));
        }
        if max_step == 0 {
            return Err(ConfigError::new("max_step", "must be at least 1"));
        }
        Ok(Rebalancer {
            budget,
            region: region.to_owned(),
            stores,
            max_step,
            dead_band,
            floor: 0,
        })
    }

    /// Never gives away below `floor` (default 0): a reserve for demand
    /// that appears later, which a region would otherwise wait for (its
    /// measurement, the transfers and the credit hold) after giving
    /// everything away while idle.
    pub fn keep_at_least(mut self, floor: u64) -> Self {
        self.floor = floor;
        self
    }

    /// One period of the rule (see the type's docs): `Some((to, amount))`
    /// when it moved `amount` to region `to`, `None` when there was nothing
    /// to move (no surplus, no need above the dead band, or no reachable
    /// receiver).
    pub async fn run_once(&self) -> Result<Option<(String, u64)>, RegionError> {
        self.budget.repair_all().await;
        let mut demand: HashMap<String, Option<u64>> = HashMap::new();
        for (name, store) in &self.stores {
            let table = store.grants(&format!("region-{name}")).await;
            let sum = table.ok().map(|t| {
                let milli: u64 = t.instances.iter().map(|i| i.demand.as_milli()).sum();
                Rate::from_milli(milli).as_milli().div_ceil(1000)
            });
            demand.insert(name.clone(), sum);
        }
        let view = self.budget.spendable(&self.region).await?;
        let allocations = self.budget.allocations().await.ok();
        let known: u64 = demand.values().flatten().sum();
        if known == 0 {
            return Ok(None);
        }
        let total = self.budget.total();
        let target = |name: &str| -> u64 {
            demand
                .get(name)
                .copied()
                .flatten()
                .map_or(0, |d| u128::from(total) * u128::from(d) / u128::from(known))
                .try_into()
                .unwrap_or(total)
        };
        let own_demand = demand.get(&self.region).copied().flatten().unwrap_or(0);
        let keep = target(&self.region).max(own_demand).max(self.floor);
        let surplus = view.saturating_sub(keep);
        if surplus <= self.dead_band {
            return Ok(None);
        }
        let allocation_of = |name: &str| {
            allocations
                .as_ref()
                .and_then(|a| a.iter().find(|(n, _)| n == name).map(|(_, a)| *a))
        };
        let mut needs: Vec<(u64, &str)> = self
            .stores
            .iter()
            .map(|(name, _)| name.as_str())
            .filter(|name| *name != self.region && demand.get(*name).copied().flatten().is_some())
            .filter_map(|name| {
                let need = target(name).saturating_sub(allocation_of(name)?);
                (need > self.dead_band).then_some((need, name))
            })
            .collect();
        needs.sort_unstable_by(|a, b| b.cmp(a));
        for (need, to) in needs {
            let amount = surplus.min(need).min(self.max_step);
            let n = self.budget.next_number(&self.region, to).await?;
            match self.budget.send(&self.region, to, n, amount).await {
                Ok(_) => return Ok(Some((to.to_owned(), amount))),
                // Unconfirmed toward this receiver, or it cannot be reached:
                // try the next one.
                Err(RegionError::InFlight { .. } | RegionError::Unreachable { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// Runs [`run_once`](Self::run_once) every `period` while this process
    /// holds the region's rebalancer role: a key in the region's Redis set
    /// with `SET NX PX` for three periods and renewed each period, so one
    /// instance of the region rebalances at a time and another takes over
    /// within three periods when it dies.
    pub fn spawn(self, period: Duration) -> tokio::task::JoinHandle<()> {
        let me = format!("{:016x}", rand::random::<u64>());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if !self.budget.hold_role(&self.region, &me, period * 3).await {
                    continue;
                }
                if let Err(e) = self.run_once().await {
                    tracing::warn!(region = &*self.region, error = %e, "rebalancing failed");
                }
            }
        })
    }
}

impl RegionalBudget {
    /// Takes or renews the rebalancer role of `region` for `holder`, for
    /// `ttl`; false if another holds it or the region is unreachable.
    pub(super) async fn hold_role(&self, region: &str, holder: &str, ttl: Duration) -> bool {
        let Some(region) = self.region(region) else {
            return false;
        };
        let key = region.state_key.replace(":state", ":rebalancer");
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut set = redis::cmd("SET");
        set.arg(&key).arg(holder).arg("NX").arg("PX").arg(ttl_ms);
        match self.call(region, Request::Cmd(&set)).await {
            Ok(redis::Value::Okay) => return true,
            Ok(_) => {}
            Err(_) => return false,
        }
        let mut get = redis::cmd("GET");
        get.arg(&key);
        let held = matches!(
            self.call(region, Request::Cmd(&get)).await,
            Ok(v) if super::ledger::text(&v).as_deref() == Some(holder)
        );
        if held {
            let mut renew = redis::cmd("PEXPIRE");
            renew.arg(&key).arg(ttl_ms);
            return self.call(region, Request::Cmd(&renew)).await.is_ok();
        }
        false
    }
}
