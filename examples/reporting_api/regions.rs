//! Running as one region of several: `--region NAME` with one
//! `--region-redis NAME=URL` and one `--region-share NAME=N` per region.
//! The dependency budget is then split into per-region allocations (the
//! shares, summing to the budget), this instance spends its region's
//! allocation through a region lease in its region's Redis, and a
//! rebalancer per region moves allocation toward demand.

/// The region flags, parsed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RegionArgs {
    pub(crate) name: Option<String>,
    pub(crate) redis: Vec<(String, String)>,
    pub(crate) shares: Vec<(String, u64)>,
}

/// The flags this module reads.
pub(crate) const FLAGS: [&str; 3] = ["--region", "--region-redis", "--region-share"];

impl RegionArgs {
    /// Takes one region flag and its value.
    pub(crate) fn take(&mut self, flag: &str, value: String) -> Result<(), String> {
        let pair = |value: &str, example: &str| {
            value
                .split_once('=')
                .map(|(n, v)| (n.to_owned(), v.to_owned()))
                .ok_or_else(|| format!("{flag} {value:?}: expected NAME=VALUE, e.g. {example}"))
        };
        match flag {
            "--region" => self.name = Some(value),
            "--region-redis" => self.redis.push(pair(&value, "eu=redis://10.0.0.1:6379/")?),
            _ => {
                let (name, share) = pair(&value, "eu=80")?;
                let share = share
                    .parse()
                    .map_err(|_| format!("{flag} {value:?}: the share must be a whole number"))?;
                self.shares.push((name, share));
            }
        }
        Ok(())
    }

    /// Checks that the flags describe whole regions.
    pub(crate) fn check(&self) -> Result<(), String> {
        let Some(name) = &self.name else {
            if self.redis.is_empty() && self.shares.is_empty() {
                return Ok(());
            }
            return Err("--region-redis and --region-share need --region NAME".to_owned());
        };
        for (region, _) in &self.redis {
            if !self.shares.iter().any(|(r, _)| r == region) {
                return Err(format!(
                    "region {region:?} has --region-redis but no --region-share"
                ));
            }
        }
        for (region, _) in &self.shares {
            if !self.redis.iter().any(|(r, _)| r == region) {
                return Err(format!(
                    "region {region:?} has --region-share but no --region-redis"
                ));
            }
        }
        if !self.redis.iter().any(|(r, _)| r == name) {
            return Err(format!(
                "--region {name:?} is not among the --region-redis regions"
            ));
        }
        Ok(())
    }
}

/// This instance's share of the dependency budget: a region lease, with its
/// view reader, lease refresher and the region's rebalancer running.
#[cfg(feature = "redis")]
pub(crate) fn region_lease(
    regions: &RegionArgs,
    name: &str,
    total: u64,
    instance_id: Option<&str>,
    expected_instances: std::num::NonZeroU32,
) -> Result<tower_admission::outbound::RateLease, tower_admission::ConfigError> {
    use std::time::Duration;
    use tower_admission::outbound::{LeaseStore, RegionalBudget};

    // Each region keeps a quarter of an even split for demand that appears.
    let floor = total / (4 * regions.redis.len() as u64).max(1);
    let mut builder = RegionalBudget::builder(total)
        .name("reporting-api")
        .rebalance_step(20)
        .dead_band(4)
        .keep_at_least(floor);
    for (region, url) in &regions.redis {
        let share = regions
            .shares
            .iter()
            .find(|(r, _)| r == region)
            .map_or(0, |(_, s)| *s);
        let store = LeaseStore::new(url, "reporting-api", Duration::from_millis(100))?;
        builder = builder
            .region(region, url, share)
            .lease_store(region, store);
    }
    let budget = builder.build()?;
    let lease = budget.lease(name, expected_instances, instance_id)?;
    let (running, region) = (lease.clone(), name.to_owned());
    // Runs for the life of the process: seeds the regions once (a no-op
    // when they exist), then reads the view, refreshes and rebalances.
    drop(tokio::spawn(async move {
        if let Err(e) = budget.initialize().await {
            tracing::warn!(error = %e, "regions not initialized; spending nothing until they are");
        }
        drop(running.spawn_refresher());
        // The region is the lease's, known to the budget.
        if let Err(e) = budget.spawn_rebalancer(&region, Duration::from_secs(1)) {
            tracing::warn!(error = %e, "no rebalancing");
        }
    }));
    Ok(lease)
}
