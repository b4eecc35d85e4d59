//! Rebalancing: moves one region's surplus toward the regions whose
//! leases are held back, by ordered transfers.

use std::collections::HashMap;
use std::time::Duration;

use super::{RegionError, RegionalBudget};
use crate::outbound::Rate;
use crate::redis::Request;

impl RegionalBudget {
    /// One period of redistribution by demand, giving from `region`:
    /// `Some((to, amount))` when it moved `amount` to region `to`, `None`
    /// when there was nothing to move (no surplus, no need above the dead
    /// band, or no reachable receiver).
    ///
    /// Each region runs its own rebalancing (every instance may run it; a
    /// per-region role lease picks one at a time, see
    /// [`spawn_rebalancer`](Self::spawn_rebalancer)), and it only ever gives
    /// away its own region's surplus: no region depends on another's
    /// rebalancer to spend what it holds, and a dead region's rebalancer
    /// stops only that region's gifts.
    ///
    /// The rule, every period:
    ///
    /// 1. Finish this region's unconfirmed transfers
    ///    ([`repair_all`](Self::repair_all)).
    /// 2. Read every region's demand from its
    ///    [lease store](super::RegionalBudgetBuilder::lease_store): the sum
    ///    of what its instances' leases reported (a held-back instance
    ///    reports at least twice its grant, so a region whose callers wait
    ///    shows the need), and this region's spendable allocation.
    /// 3. Fair targets: the total split in proportion to demand (nothing
    ///    moves while no demand is known).
    /// 4. This region's surplus is `spendable − max(target, demand, floor)`
    ///    (the floor from
    ///    [`keep_at_least`](super::RegionalBudgetBuilder::keep_at_least)); a
    ///    receiver's need is `target − allocation`. If both exceed the
    ///    [dead band](super::RegionalBudgetBuilder::dead_band), send
    ///    `min(surplus, need, max_step)` (the
    ///    [step](super::RegionalBudgetBuilder::rebalance_step)) to the
    ///    neediest reachable receiver that is held back: one of its
    ///    instances reported a demand held back by its grant, or a guess. A
    ///    region whose demands all fit their grants needs nothing, whatever
    ///    its proportional target: an idle region's instances still report
    ///    their floor demand, and counted as need it drew allocation away
    ///    from a region that was waiting. A receiver whose demand could not
    ///    be read (its Redis down) or whose last transfer is unconfirmed gets
    ///    nothing this period: no transfer is sent into a region that cannot
    ///    confirm one, so an outage strands at most one `max_step` per pair.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// if let Some((to, amount)) = budget.rebalance_once("eu").await? {
    ///     println!("eu gave {amount} to {to}");
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn rebalance_once(&self, region: &str) -> Result<Option<(String, u64)>, RegionError> {
        self.known_region(region)?;
        let settings = self.inner.rebalance;
        let total = self.total();
        let max_step = settings.max_step.unwrap_or((total / 20).max(1));
        let dead_band = settings.dead_band.unwrap_or(total / 100);
        self.repair_all().await;
        let mut demand: HashMap<String, Option<u64>> = HashMap::new();
        let mut held_back: Vec<&str> = Vec::new();
        for (name, store) in &self.inner.lease_stores {
            let table = store.grants(&format!("region-{name}")).await;
            if table
                .as_ref()
                .is_ok_and(|t| t.instances.iter().any(|i| i.guessed))
            {
                held_back.push(name);
            }
            let sum = table.ok().map(|t| {
                let milli: u64 = t.instances.iter().map(|i| i.demand.as_milli()).sum();
                Rate::from_milli(milli).as_milli().div_ceil(1000)
            });
            demand.insert(name.clone(), sum);
        }
        let view = self.spendable(region).await?;
        let allocations = self.allocations().await.ok();
        let known: u64 = demand.values().flatten().sum();
        if known == 0 {
            return Ok(None);
        }
        let target = |name: &str| -> u64 {
            demand
                .get(name)
                .copied()
                .flatten()
                .map_or(0, |d| u128::from(total) * u128::from(d) / u128::from(known))
                .try_into()
                .unwrap_or(total)
        };
        let own_demand = demand.get(region).copied().flatten().unwrap_or(0);
        let keep = target(region).max(own_demand).max(settings.floor);
        let surplus = view.saturating_sub(keep);
        if surplus <= dead_band {
            return Ok(None);
        }
        let allocation_of = |name: &str| {
            allocations
                .as_ref()
                .and_then(|a| a.iter().find(|(n, _)| n == name).map(|(_, a)| *a))
        };
        let mut needs: Vec<(u64, &str)> = self
            .inner
            .lease_stores
            .iter()
            .map(|(name, _)| name.as_str())
            .filter(|name| *name != region && held_back.contains(name))
            .filter_map(|name| {
                let need = target(name).saturating_sub(allocation_of(name)?);
                (need > dead_band).then_some((need, name))
            })
            .collect();
        needs.sort_unstable_by(|a, b| b.cmp(a));
        for (need, to) in needs {
            let amount = surplus.min(need).min(max_step);
            let n = self.next_number(region, to).await?;
            match self.send(region, to, n, amount).await {
                Ok(_) => return Ok(Some((to.to_owned(), amount))),
                // Unconfirmed toward this receiver, or it cannot be reached:
                // try the next one.
                Err(RegionError::InFlight { .. } | RegionError::Unreachable { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// Runs [`rebalance_once`](Self::rebalance_once) for `region` every
    /// `period` while this process holds the region's rebalancer role: a key
    /// in the region's Redis set with `SET NX PX` for three periods and
    /// renewed each period, so one instance of the region rebalances at a
    /// time and another takes over within three periods when it dies.
    /// Dropping the handle does not stop it; abort it.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let task = budget.spawn_rebalancer("eu", std::time::Duration::from_secs(1))?;
    /// # task.abort();
    /// # Ok(())
    /// # }
    /// ```
    pub fn spawn_rebalancer(
        &self,
        region: &str,
        period: Duration,
    ) -> Result<tokio::task::JoinHandle<()>, RegionError> {
        self.known_region(region)?;
        let (budget, region) = (self.clone(), region.to_owned());
        let me = format!("{:016x}", rand::random::<u64>());
        Ok(tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if !budget.hold_role(&region, &me, period * 3).await {
                    continue;
                }
                if let Err(e) = budget.rebalance_once(&region).await {
                    tracing::warn!(region = &*region, error = %e, "rebalancing failed");
                }
            }
        }))
    }

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
