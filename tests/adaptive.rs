//! The adaptive global limit, criticality classes and fair queues, against
//! a simulated dependency in virtual time: processor sharing with capacity
//! C, so up to C requests in flight take the base latency and above C each
//! takes `base × in_flight / C`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tower::{service_fn, Layer, Service, ServiceExt};
use tower_admission::concurrency::{AdaptiveLimit, ConcurrencyLayer, Criticality, OverloadReason};
use tower_admission::identity::Identity;

const BASE: Duration = Duration::from_millis(20);

/// Jobs with work left, in ms at full rate; one tick per virtual ms.
#[derive(Default)]
struct Dependency {
    jobs: Mutex<Vec<(f64, oneshot::Sender<()>)>>,
}

impl Dependency {
    /// Starts the ticker of a dependency of `capacity`.
    fn start(capacity: usize) -> Arc<Self> {
        let dep = Arc::new(Dependency::default());
        let ticking = Arc::clone(&dep);
        tokio::spawn(async move {
            let mut at = Instant::now();
            loop {
                at += Duration::from_millis(1);
                tokio::time::sleep_until(at).await;
                ticking.tick(capacity);
            }
        });
        dep
    }

    async fn call(&self) {
        let (tx, rx) = oneshot::channel();
        self.jobs
            .lock()
            .unwrap()
            .push((BASE.as_secs_f64() * 1000.0, tx));
        let _ = rx.await;
    }

    /// One ms of processor sharing, water-filling shortest first.
    fn tick(&self, capacity: usize) {
        let mut jobs = self.jobs.lock().unwrap();
        jobs.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut left = capacity as f64;
        let n = jobs.len();
        for (i, job) in jobs.iter_mut().enumerate() {
            let work = job.0.min((left / (n - i) as f64).min(1.0));
            job.0 -= work;
            left -= work;
        }
        jobs.retain_mut(|job| {
            if job.0 <= 1e-9 {
                let (tx, _) = oneshot::channel();
                let _ = std::mem::replace(&mut job.1, tx).send(());
                false
            } else {
                true
            }
        });
    }
}

/// What happened to each request of a stream.
#[derive(Debug, Default, Clone)]
struct Tally {
    ok: usize,
    refused: HashMap<OverloadReason, usize>,
    latencies: Vec<Duration>,
}

impl Tally {
    fn refused(&self) -> usize {
        self.refused.values().sum()
    }

    fn p99(&mut self) -> Duration {
        self.latencies.sort();
        let n = self.latencies.len();
        self.latencies[(n * 99).div_ceil(100) - 1]
    }
}

type Tallies = Arc<Mutex<HashMap<String, Tally>>>;

fn request(subject: &str, tenant: &str, plan: &str) -> Request<Full<Bytes>> {
    let mut req = Request::new(Full::default());
    req.extensions_mut().insert(Identity::new(
        subject.to_owned(),
        tenant.to_owned(),
        plan.to_owned(),
    ));
    req
}

/// A stream of requests: its name (the tally's key), the identity's
/// subject, tenant and plan, and its rate in requests per ms.
struct Stream {
    name: &'static str,
    tenant: String,
    plan: &'static str,
    per_ms: f64,
}

/// Sends `streams` evenly for `run`, counting only requests that arrive
/// from `count_from` on; waits for the last to answer.
async fn drive<S>(svc: S, streams: &[Stream], run: Duration, count_from: Duration) -> Tallies
where
    S: Service<
            Request<Full<Bytes>>,
            Response = Response<tower_admission::concurrency::PermitBody<Full<Bytes>>>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    let tallies: Tallies = Arc::default();
    let start = Instant::now();
    let mut due = vec![0.0f64; streams.len()];
    let mut tasks = Vec::new();
    for ms in 0..run.as_millis() as u64 {
        tokio::time::sleep_until(start + Duration::from_millis(ms)).await;
        for (i, stream) in streams.iter().enumerate() {
            due[i] += stream.per_ms;
            while due[i] >= 1.0 {
                due[i] -= 1.0;
                let counted = Duration::from_millis(ms) >= count_from;
                let req = request(stream.name, &stream.tenant, stream.plan);
                let svc = svc.clone();
                let tallies = Arc::clone(&tallies);
                let name = stream.name.to_owned();
                tasks.push(tokio::spawn(async move {
                    let arrived = Instant::now();
                    let response = svc.oneshot(req).await.unwrap();
                    let latency = arrived.elapsed();
                    let reason = response.extensions().get::<OverloadReason>().copied();
                    drop(response);
                    if !counted {
                        return;
                    }
                    let mut tallies = tallies.lock().unwrap();
                    let tally = tallies.entry(name).or_default();
                    match reason {
                        None => {
                            tally.ok += 1;
                            tally.latencies.push(latency);
                        }
                        Some(reason) => *tally.refused.entry(reason).or_default() += 1,
                    }
                }));
            }
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    tallies
}

fn dependency_service(
    dep: Arc<Dependency>,
) -> impl Service<
    Request<Full<Bytes>>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl std::future::Future<Output = Result<Response<Full<Bytes>>, Infallible>> + Send,
> + Clone
       + Send
       + 'static {
    service_fn(move |_req: Request<Full<Bytes>>| {
        let dep = Arc::clone(&dep);
        async move {
            dep.call().await;
            Ok::<_, Infallible>(Response::new(Full::default()))
        }
    })
}

fn plan_class(parts: &http::request::Parts) -> Criticality {
    match parts.extensions.get::<Identity>().map(Identity::plan) {
        Some("enterprise") => Criticality::Critical,
        Some("free") => Criticality::Sheddable,
        _ => Criticality::Default,
    }
}

/// Critical work at 60 % of capacity beside sheddable work at 3 × capacity:
/// every critical request after the first probe succeeds within 1.5 × the
/// base latency, and sheddable work fills the rest of the capacity and no
/// more.
#[tokio::test(start_paused = true)]
async fn critical_work_keeps_its_share_while_sheddable_work_floods() {
    const C: usize = 20;
    let per_base = |share: f64| share * C as f64 / BASE.as_millis() as f64;
    let dep = Dependency::start(C);
    let layer = ConcurrencyLayer::builder()
        .global_adaptive(
            AdaptiveLimit::default().bounds(1, 1000),
            64,
            Duration::from_millis(500),
        )
        .criticality(plan_class)
        .build()
        .unwrap();
    let svc = layer.layer(dependency_service(dep));
    let streams = [
        Stream {
            name: "critical",
            tenant: "a".into(),
            plan: "enterprise",
            per_ms: per_base(0.6),
        },
        Stream {
            name: "sheddable",
            tenant: "b".into(),
            plan: "free",
            per_ms: per_base(3.0),
        },
    ];
    let run = Duration::from_secs(20);
    let count_from = Duration::from_secs(2);
    let tallies = drive(svc, &streams, run, count_from).await;
    let mut tallies = tallies.lock().unwrap();
    let counted_ms = (run - count_from).as_millis() as usize;

    let critical = tallies.get_mut("critical").unwrap();
    let sent = critical.ok + critical.refused();
    assert_eq!(sent, counted_ms * 6 / 10);
    assert!(critical.ok * 1000 >= sent * 999, "{critical:?}");
    let p99 = critical.p99();
    assert!(p99 <= BASE.mul_f64(1.5), "critical p99 {p99:?}");
    let (critical_ok, critical_p99) = (critical.ok, p99);

    let sheddable = tallies.get_mut("sheddable").unwrap();
    // What is left: the 40 % of capacity critical work does not use.
    let left = counted_ms * C * 4 / 10 / BASE.as_millis() as usize;
    assert!(
        sheddable.ok * 100 >= left * 95,
        "{} of {left}",
        sheddable.ok
    );
    assert!(sheddable.ok <= left, "{} of {left}", sheddable.ok);
    let sheddable_p99 = sheddable.p99();
    assert_eq!(
        (critical_ok, critical_p99, sheddable.ok, sheddable_p99),
        (
            10800,
            Duration::from_millis(25),
            7200,
            Duration::from_millis(190)
        ),
    );
    let stats = layer.stats();
    // Refused during the first baseline probe (the limit at 3 in flight
    // for 25 answers, before 2 s), when the critical queue of 64 filled.
    assert_eq!(stats.class_shed(Criticality::Critical), 19);
    assert_eq!(stats.global_in_flight, 0);
}

/// Nine tenants at their share of a fixed limit of 10 (one request in
/// flight each) beside one at 10 × its share: with `fair_by`, every one of
/// the nine keeps at least 99 % success and the flooder gets no more than
/// its share of the admissions; without it (one queue in arrival order),
/// the nine lose far more.
#[tokio::test(start_paused = true)]
async fn a_flooding_tenant_gets_its_fair_share_and_no_more() {
    const C: usize = 10;
    let share_per_ms = 1.0 / BASE.as_millis() as f64;
    let mut streams: Vec<Stream> = (0..9)
        .map(|i| Stream {
            name: ["t0", "t1", "t2", "t3", "t4", "t5", "t6", "t7", "t8"][i],
            tenant: format!("tenant-{i}"),
            plan: "pro",
            per_ms: share_per_ms,
        })
        .collect();
    streams.push(Stream {
        name: "flooder",
        tenant: "tenant-flood".into(),
        plan: "pro",
        per_ms: 10.0 * share_per_ms,
    });
    let run = Duration::from_secs(20);
    let count_from = Duration::from_secs(1);
    let counted_ms = (run - count_from).as_millis() as usize;
    let fair_share = counted_ms * C / BASE.as_millis() as usize / 10;

    let mut outcomes = Vec::new();
    for fair in [true, false] {
        let dep = Dependency::start(C);
        let mut builder = ConcurrencyLayer::builder().global(C, 20, Duration::from_millis(200));
        if fair {
            builder = builder.fair_by(|parts| {
                parts
                    .extensions
                    .get::<Identity>()
                    .map(|id| Arc::clone(id.tenant_arc()))
            });
        } else {
            // The same gate, one queue in arrival order.
            builder = builder.fair_by(|_| None);
        }
        let layer = builder.build().unwrap();
        let svc = layer.layer(dependency_service(dep));
        let tallies = drive(svc, &streams, run, count_from).await;
        let tallies = tallies.lock().unwrap();
        let nine: Vec<(usize, usize)> = streams[..9]
            .iter()
            .map(|s| {
                let t = &tallies[s.name];
                (t.ok, t.ok + t.refused())
            })
            .collect();
        let flooder = &tallies["flooder"];
        outcomes.push((nine, flooder.ok, flooder.refused()));
    }
    let (fair_nine, fair_flooder, _) = &outcomes[0];
    for (ok, sent) in fair_nine {
        assert_eq!(*sent, counted_ms / BASE.as_millis() as usize);
        assert!(ok * 100 >= sent * 99, "{ok} of {sent}");
    }
    assert!(
        *fair_flooder <= fair_share,
        "{fair_flooder} over {fair_share}"
    );
    let (fifo_nine, fifo_flooder, _) = &outcomes[1];
    let worst = fifo_nine.iter().map(|(ok, _)| *ok).min().unwrap();
    assert!(worst * 100 < fifo_nine[0].1 * 99, "{fifo_nine:?}");
    assert!(*fifo_flooder > fair_share);
    assert_eq!(
        (
            fair_nine.iter().map(|(ok, _)| ok).sum::<usize>(),
            *fair_flooder,
            worst,
            *fifo_flooder
        ),
        (8550, 950, 0, 8550),
    );
}

/// Sheddable work alone, held to half the limit, still reaches the
/// dependency's capacity: its requests that find no slot are evidence that
/// the limit is used, so the limit grows until the latency says stop.
#[tokio::test(start_paused = true)]
async fn a_class_held_to_its_share_still_fills_the_capacity() {
    const C: usize = 20;
    let dep = Dependency::start(C);
    let layer = ConcurrencyLayer::builder()
        .global_adaptive(AdaptiveLimit::default(), 0, Duration::ZERO)
        .criticality(plan_class)
        .class_shares(0.5, 0.9)
        .build()
        .unwrap();
    let svc = layer.layer(dependency_service(dep));
    let streams = [Stream {
        name: "sheddable",
        tenant: "b".into(),
        plan: "free",
        per_ms: 2.0 * C as f64 / BASE.as_millis() as f64,
    }];
    let run = Duration::from_secs(20);
    let count_from = Duration::from_secs(5);
    let tallies = drive(svc, &streams, run, count_from).await;
    let mut tallies = tallies.lock().unwrap();
    let sheddable = tallies.get_mut("sheddable").unwrap();
    let capacity = (run - count_from).as_millis() as usize * C / BASE.as_millis() as usize;
    assert!(
        sheddable.ok * 100 >= capacity * 95,
        "{} of {capacity}",
        sheddable.ok
    );
    let p99 = sheddable.p99();
    assert!(p99 <= 2 * BASE, "{p99:?}");
    let limit = layer.stats().limit.unwrap();
    assert_eq!(
        (sheddable.ok, p99, limit),
        (15000, Duration::from_millis(25), 52)
    );
}
