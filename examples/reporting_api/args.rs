//! The command line of the reporting API; see `main.rs` for the flags.

use std::net::SocketAddr;
use std::num::NonZeroU32;

use crate::regions::{self, RegionArgs};

pub(crate) const USAGE: &str = "usage: reporting_api [--config PATH] [--listen ADDR] [--redis URL]
                     [--budget-redis URL] [--dependency-url URL] [--instance-id ID]
                     [--expected-instances N] [--pushback] [--region NAME
                     --region-redis NAME=URL... --region-share NAME=N...]";

/// What `--help` prints: the usage, then every flag with its default.
pub(crate) const HELP: &str =
    "The sample reporting API: every layer of tower-admission on one service.

usage: reporting_api [--config PATH] [--listen ADDR] [--redis URL]
                     [--budget-redis URL] [--dependency-url URL] [--instance-id ID]
                     [--expected-instances N] [--pushback] [--region NAME
                     --region-redis NAME=URL... --region-share NAME=N...]

  --config PATH            every other knob (quotas, caps, keys, timeouts), in a file
                           shaped like examples/reporting_api/reporting.toml; default: that
                           file, built in
  --listen ADDR            the address to serve on; default 127.0.0.1:3000, or the file's
                           server.listen (port 0: any free port, printed at start)
  --redis URL              keep the quotas in Redis, shared by every instance given the same
                           URL, and the dependency budget as one rate lease for the fleet;
                           default: the file's server.redis, else everything in memory
                           (needs --features redis)
  --budget-redis URL       with --redis: the lease in another Redis; default: the --redis one
  --dependency-url URL     the shared dependency batch items call; default: a mock served in
                           this process
  --instance-id ID         with --redis: this instance's name in the lease table; default random
  --expected-instances N   with --redis: the largest fleet; while the lease's Redis cannot be
                           reached, each instance spends 240/N attempts per second; default 40
  --pushback               with --redis: follow the dependency's pushback (429, 503 with
                           Retry-After, nothing remaining): the fleet's budget halves and grows
                           back when it stops (docs/leases.md, \"Pushback\"); default off
  --region NAME            with --redis: run as one region of several; the dependency budget
                           is split into per-region allocations that follow demand
  --region-redis NAME=URL  with --region, once per region: that region's own Redis
  --region-share NAME=N    with --region, once per region: its initial allocation per second;
                           the shares sum to the budget (240)
  -h, --help               print this and exit

Demo keys (Authorization: Bearer KEY): demo-free, demo-pro, demo-globex.
Routes: GET /healthz, GET /metrics, GET /v1/reports, POST /v1/reports/batch, GET /v1/jobs/ID.
SIGHUP, or a change of the --config file: reload it (quotas, caps, budget); a bad file
keeps the running configuration.
SIGINT or SIGTERM: in-flight requests finish and accepted jobs drain (shutdown.limit, 60 s);
a second signal exits at once. Exit status: 0 after a clean stop, 1 when the start or the
shutdown fails, 2 for a bad command line or configuration.";

/// Flags that only shape the fleet-wide lease, so they need `--redis`.
const LEASE_FLAGS: [&str; 4] = [
    "--budget-redis",
    "--instance-id",
    "--expected-instances",
    "--pushback",
];

/// The command line, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Args {
    pub(crate) config: Option<std::path::PathBuf>,
    pub(crate) listen: SocketAddr,
    /// `--listen` was given: it wins over the file's `server.listen`.
    pub(crate) listen_given: bool,
    pub(crate) redis: Option<String>,
    pub(crate) budget_redis: Option<String>,
    pub(crate) dependency_url: Option<String>,
    pub(crate) instance_id: Option<String>,
    pub(crate) expected_instances: NonZeroU32,
    /// Follow the dependency's pushback (with `--redis`).
    pub(crate) pushback: bool,
    pub(crate) regions: RegionArgs,
}

/// Parses the arguments after the program's name: `None` for `--help`.
pub(crate) fn parse(args: impl IntoIterator<Item = String>) -> Result<Option<Args>, String> {
    let mut parsed = Args {
        config: None,
        listen: SocketAddr::from(([127, 0, 0, 1], 3000)),
        listen_given: false,
        redis: None,
        budget_redis: None,
        dependency_url: None,
        instance_id: None,
        expected_instances: NonZeroU32::new(40).unwrap_or(NonZeroU32::MIN),
        pushback: false,
        regions: RegionArgs::default(),
    };
    // The flags given that only shape the fleet's lease in Redis.
    let mut lease_flags: Vec<String> = Vec::new();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let mut value = |example: &str| {
            args.next()
                .ok_or_else(|| format!("{arg} needs a value, e.g. {arg} {example}"))
        };
        if LEASE_FLAGS.contains(&arg.as_str()) && !lease_flags.contains(&arg) {
            lease_flags.push(arg.clone());
        }
        match arg.as_str() {
            "--config" => {
                parsed.config = Some(value("examples/reporting_api/reporting.toml")?.into())
            }
            "--listen" => {
                let v = value("127.0.0.1:3000")?;
                parsed.listen = v.parse().map_err(|e| format!("--listen {v:?}: {e}"))?;
                parsed.listen_given = true;
            }
            "--redis" => parsed.redis = Some(value("redis://127.0.0.1:6379/")?),
            "--budget-redis" => parsed.budget_redis = Some(value("redis://127.0.0.1:6379/")?),
            "--dependency-url" => parsed.dependency_url = Some(value("http://127.0.0.1:3300")?),
            "--instance-id" => parsed.instance_id = Some(value("api-1")?),
            "--expected-instances" => {
                let v = value("40")?;
                parsed.expected_instances = v.parse().map_err(|_| {
                    format!("--expected-instances {v:?}: must be a whole number from 1")
                })?;
            }
            "--pushback" => parsed.pushback = true,
            flag if regions::FLAGS.contains(&flag) => {
                let v = value("eu=redis://10.0.0.1:6379/")?;
                parsed.regions.take(flag, v)?;
            }
            "-h" | "--help" => return Ok(None),
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    if let (Some(flag), None) = (lease_flags.first(), &parsed.redis) {
        return Err(format!(
            "{flag} needs --redis: it shapes the fleet's lease of the dependency budget \
             in Redis, and without --redis each instance has a whole budget of its own"
        ));
    }
    parsed.regions.check()?;
    if parsed.regions.name.is_some() && parsed.redis.is_none() {
        return Err(
            "--region needs --redis: the regions share one budget through Redis".to_owned(),
        );
    }
    Ok(Some(parsed))
}
