//! The mock's command line.

use std::fmt;
use std::net::SocketAddr;

use super::config::{Field, MockConfig};

/// The command line, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Command {
    /// Serve the mock on `listen`.
    Serve {
        /// Where to listen.
        listen: SocketAddr,
        /// How the mock behaves.
        config: MockConfig,
    },
    /// Print [`USAGE`] and exit.
    Help,
}

/// The default `--listen` address.
pub(crate) const DEFAULT_LISTEN: &str = "127.0.0.1:3300";

/// What `--help` prints.
pub(crate) const USAGE: &str = "\
usage: mock_dependency [--listen ADDR] [--limit N] [--latency-ms MS] [--capacity C] [--fail-every K]

  --listen ADDR     where to listen (default 127.0.0.1:3300)
  --limit N         the most arrivals in any 1 s, refused ones included; the
                    one over it is answered 429 with Retry-After: 1 (default 300)
  --latency-ms MS   the work of every arrival: how long it takes while no more
                    than --capacity are in flight, 0 to 3600000 (default 5)
  --capacity C      how many arrivals are served at full speed at once; above
                    it they share it, so n in flight each take
                    latency x n / C; 0 = unlimited (default 0)
  --fail-every K    answer 503 to every K-th accepted arrival; 0 = never (default 0)

GET /config shows the settings and POST /config changes any of them at once
(JSON: limit, latency_ms, capacity, fail_every). GET /stats, GET /stats/series
and POST /stats/reset report and clear the counts.";

/// A refused command line: the flag at fault and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ArgError {
    /// The flag (or the unknown argument) at fault.
    pub(crate) flag: String,
    /// What is wrong with it.
    pub(crate) reason: String,
}

impl fmt::Display for ArgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.flag, self.reason)
    }
}

impl std::error::Error for ArgError {}

/// Parses the arguments after the program name. Each flag takes its value as
/// the next argument or after `=` (`--limit 50` or `--limit=50`).
pub(crate) fn parse_args<I>(args: I) -> Result<Command, ArgError>
where
    I: IntoIterator,
    I::Item: Into<String>,
{
    let mut listen: SocketAddr = DEFAULT_LISTEN.parse().expect("the default address parses");
    let mut config = MockConfig::default();
    let mut args = args.into_iter().map(Into::into);
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => {
                (flag.to_owned(), Some(value.to_owned()))
            }
            _ => (arg, None),
        };
        let error = |reason: String| ArgError {
            flag: flag.clone(),
            reason,
        };
        let mut value = |example: &str| {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| error(format!("needs a value, e.g. {flag} {example}")))
        };
        if let Some(field) = Field::ALL.into_iter().find(|f| f.flag() == flag) {
            let example = field.get(&MockConfig::default()).max(1).to_string();
            let v = value(&example)?;
            let parsed = v.parse::<u64>().map_err(|_| ());
            parsed
                .and_then(|n| field.set(&mut config, n).map_err(|_| ()))
                .map_err(|()| error(format!("{v:?} is not {}", field.expected())))?;
            continue;
        }
        match flag.as_str() {
            "--listen" => {
                let v = value(DEFAULT_LISTEN)?;
                listen = v.parse().map_err(|e| {
                    error(format!("{v:?} is not an address like 127.0.0.1:3300 ({e})"))
                })?;
            }
            "-h" | "--help" => return Ok(Command::Help),
            _ => {
                return Err(ArgError {
                    flag,
                    reason: "unknown argument; try --help".to_owned(),
                })
            }
        }
    }
    Ok(Command::Serve { listen, config })
}
