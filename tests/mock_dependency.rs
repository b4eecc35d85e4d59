//! The mock dependency, in-process through its router, on tokio's paused clock.

#[path = "../examples/mock_dependency/mock.rs"]
mod mock;

use std::num::{NonZeroU32, NonZeroU64};
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use axum::Router;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use mock::{parse_args, ArgError, Command, MockConfig, MockHandle, Stats, WINDOW};
use serde_json::{json, Value};
use tokio::time::Instant;
use tower::ServiceExt;

fn mock(limit: u32, latency_ms: u64, fail_every: u64) -> (Router, MockHandle) {
    mock::router(MockConfig {
        limit: NonZeroU32::new(limit).unwrap(),
        latency: Duration::from_millis(latency_ms),
        fail_every: NonZeroU64::new(fail_every),
        ..MockConfig::default()
    })
}

async fn send(app: &Router, method: Method, uri: &str) -> Response {
    let request = Request::builder()
        .method(method)
        .uri(uri)
        .body(Body::empty())
        .unwrap();
    app.clone().oneshot(request).await.unwrap()
}

async fn hit(app: &Router) -> StatusCode {
    send(app, Method::GET, "/v1/reports").await.status()
}

/// `n` arrivals at one instant: every request is polled, and so arrives, before
/// the paused clock moves on to the first one's latency.
async fn burst(app: &Router, n: usize) -> Vec<Response> {
    futures_util::future::join_all((0..n).map(|_| send(app, Method::GET, "/v1/reports"))).await
}

fn count(responses: &[Response], status: StatusCode) -> usize {
    responses.iter().filter(|r| r.status() == status).count()
}

async fn json_body(response: Response) -> Value {
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&bytes).unwrap()
}

async fn stats(app: &Router) -> Value {
    let response = send(app, Method::GET, "/stats").await;
    assert_eq!(response.status(), StatusCode::OK);
    json_body(response).await
}

#[tokio::test(start_paused = true)]
async fn fifteen_arrivals_at_one_instant_admit_ten_and_refuse_five() {
    let (app, handle) = mock(10, 5, 0);
    let start = Instant::now();
    let responses = burst(&app, 15).await;
    assert_eq!(
        start.elapsed(),
        Duration::from_millis(5),
        "all answered after one latency"
    );

    assert_eq!(count(&responses, StatusCode::OK), 10);
    assert_eq!(count(&responses, StatusCode::TOO_MANY_REQUESTS), 5);
    for response in responses {
        if response.status() == StatusCode::TOO_MANY_REQUESTS {
            assert_eq!(response.headers()["retry-after"], "1");
        } else {
            assert_eq!(json_body(response).await, json!({"ok": true}));
        }
    }
    // max_in_any_1s counts arrivals, the refused five included.
    assert_eq!(
        stats(&app).await,
        json!({"total": 15, "max_in_any_1s": 15, "max_concurrent": 15, "rejected": 5, "failed": 0,
                "p50_ms": 5, "p99_ms": 5})
    );
    assert_eq!(
        handle.stats(),
        Stats {
            total: 15,
            max_in_any_1s: 15,
            max_concurrent: 15,
            rejected: 5,
            failed: 0,
            p50_ms: Some(5),
            p99_ms: Some(5),
        }
    );
}

#[tokio::test(start_paused = true)]
async fn one_second_later_ten_more_are_admitted() {
    let (app, _handle) = mock(10, 5, 0);
    let t0 = Instant::now();
    let first = burst(&app, 15).await;
    assert_eq!(count(&first, StatusCode::OK), 10);

    // Exactly 1 s after the burst: the window (t0, t0 + 1 s] no longer holds it.
    tokio::time::advance(t0 + WINDOW - Instant::now()).await;
    assert_eq!(Instant::now() - t0, WINDOW);
    let second = burst(&app, 10).await;
    assert_eq!(count(&second, StatusCode::OK), 10);
    // The eleventh of the new second is over the limit again.
    assert_eq!(hit(&app).await, StatusCode::TOO_MANY_REQUESTS);

    assert_eq!(
        stats(&app).await,
        json!({"total": 26, "max_in_any_1s": 15, "max_concurrent": 15, "rejected": 6, "failed": 0,
                "p50_ms": 5, "p99_ms": 5})
    );
}

#[tokio::test(start_paused = true)]
async fn the_window_is_the_last_second_of_arrivals_refused_ones_included() {
    let (app, handle) = mock(1, 0, 0);
    assert_eq!(hit(&app).await, StatusCode::OK); // t0
    tokio::time::advance(Duration::from_millis(999)).await;
    assert_eq!(hit(&app).await, StatusCode::TOO_MANY_REQUESTS); // t0 is still in (t - 1 s, t]
    tokio::time::advance(Duration::from_millis(1)).await;
    // t0 has left the window, but the refused arrival at t0 + 999 ms has not.
    assert_eq!(hit(&app).await, StatusCode::TOO_MANY_REQUESTS);
    tokio::time::advance(WINDOW).await;
    assert_eq!(hit(&app).await, StatusCode::OK);
    assert_eq!(
        handle.stats(),
        Stats {
            total: 4,
            max_in_any_1s: 2,
            max_concurrent: 1,
            rejected: 2,
            failed: 0,
            p50_ms: Some(0),
            p99_ms: Some(0),
        }
    );
}

#[tokio::test(start_paused = true)]
async fn fail_every_three_fails_exactly_every_third_accepted_arrival() {
    let (app, _handle) = mock(100, 5, 3);
    let mut statuses = Vec::new();
    for _ in 0..9 {
        statuses.push(hit(&app).await);
    }
    let (ok, failed) = (StatusCode::OK, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(statuses, [ok, ok, failed, ok, ok, failed, ok, ok, failed]);
    assert_eq!(
        stats(&app).await,
        json!({"total": 9, "max_in_any_1s": 9, "max_concurrent": 1, "rejected": 0, "failed": 3,
                "p50_ms": 5, "p99_ms": 5})
    );

    // Refused arrivals are not accepted ones: they do not move the count of K.
    let (app, handle) = mock(4, 5, 3);
    let responses = burst(&app, 6).await;
    assert_eq!(count(&responses, ok), 3);
    assert_eq!(count(&responses, failed), 1); // the 3rd accepted
    assert_eq!(count(&responses, StatusCode::TOO_MANY_REQUESTS), 2);
    tokio::time::advance(WINDOW).await;
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(hit(&app).await);
    }
    assert_eq!(statuses, [ok, failed, ok]); // the 5th, 6th and 7th accepted
    assert_eq!(handle.stats().failed, 2);
    assert_eq!(handle.stats().rejected, 2);
}

#[tokio::test(start_paused = true)]
async fn max_concurrent_is_the_most_requests_in_flight_together() {
    let (app, handle) = mock(100, 100, 0);
    let spawn_together = |n: usize| {
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let app = app.clone();
                tokio::spawn(async move { hit(&app).await })
            })
            .collect();
        async move {
            for task in tasks {
                assert_eq!(task.await.unwrap(), StatusCode::OK);
            }
        }
    };

    let start = Instant::now();
    spawn_together(7).await;
    assert_eq!(
        start.elapsed(),
        Duration::from_millis(100),
        "the seven overlapped"
    );
    assert_eq!(handle.stats().max_concurrent, 7);

    // Fewer at once later leave the maximum alone.
    spawn_together(3).await;
    assert_eq!(hit(&app).await, StatusCode::OK);
    assert_eq!(stats(&app).await["max_concurrent"], 7);

    // After a reset only what is in flight from then on counts: the seven
    // were released when they were answered.
    handle.reset();
    spawn_together(3).await;
    assert_eq!(handle.stats().max_concurrent, 3);
    assert_eq!(hit(&app).await, StatusCode::OK);
    assert_eq!(handle.stats().max_concurrent, 3);
}

#[tokio::test(start_paused = true)]
async fn reset_clears_everything_and_answers_204() {
    let (app, handle) = mock(3, 5, 2);
    let responses = burst(&app, 5).await;
    assert_eq!(count(&responses, StatusCode::TOO_MANY_REQUESTS), 2);
    assert_eq!(
        stats(&app).await,
        json!({"total": 5, "max_in_any_1s": 5, "max_concurrent": 5, "rejected": 2, "failed": 1,
                "p50_ms": 5, "p99_ms": 5})
    );

    let start = Instant::now();
    let response = send(&app, Method::POST, "/stats/reset").await;
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    assert_eq!(
        stats(&app).await,
        json!({"total": 0, "max_in_any_1s": 0, "max_concurrent": 0, "rejected": 0, "failed": 0,
                "p50_ms": null, "p99_ms": null})
    );
    assert_eq!(handle.stats(), Stats::default());
    assert_eq!(
        start.elapsed(),
        Duration::ZERO,
        "control paths answer at once"
    );
    // Control paths are never arrivals, whatever the method.
    assert_eq!(
        send(&app, Method::GET, "/stats/reset").await.status(),
        StatusCode::METHOD_NOT_ALLOWED
    );
    assert_eq!(stats(&app).await["total"], 0);

    // The arrival log and the fail-every count start over too, at the same instant.
    let responses = burst(&app, 3).await;
    assert_eq!(count(&responses, StatusCode::OK), 2);
    assert_eq!(count(&responses, StatusCode::SERVICE_UNAVAILABLE), 1);
    assert_eq!(
        handle.stats(),
        Stats {
            total: 3,
            max_in_any_1s: 3,
            max_concurrent: 3,
            rejected: 0,
            failed: 1,
            p50_ms: Some(5),
            p99_ms: Some(5),
        }
    );
}

#[tokio::test(start_paused = true)]
async fn the_series_counts_arrivals_per_second_since_the_reset() {
    let (app, handle) = mock(10, 5, 0);
    let start = Instant::now();
    let at = |ms: u64| start + Duration::from_millis(ms);
    // Second 0: a burst of 15 (5 refused, still arrivals); second 2: 3;
    // second 1 has none.
    burst(&app, 15).await;
    tokio::time::advance(at(2_500) - Instant::now()).await;
    burst(&app, 3).await;
    assert_eq!(
        json_body(send(&app, Method::GET, "/stats/series").await).await,
        json!({"first_second": 0, "arrivals": [15, 0, 3]})
    );
    // Reading it is no arrival, and the seconds without arrivals up to now
    // are zeros; the last entry is the second in progress.
    tokio::time::advance(at(4_000) - Instant::now()).await;
    assert_eq!(handle.stats().total, 18);
    assert_eq!(
        handle.series(),
        mock::Series {
            first_second: 0,
            arrivals: vec![15, 0, 3, 0, 0]
        }
    );

    // A reset starts the seconds again from its own instant.
    tokio::time::advance(Duration::from_millis(700)).await;
    assert_eq!(
        send(&app, Method::POST, "/stats/reset").await.status(),
        StatusCode::NO_CONTENT
    );
    tokio::time::advance(Duration::from_millis(999)).await;
    hit(&app).await;
    tokio::time::advance(Duration::from_millis(1)).await;
    hit(&app).await;
    assert_eq!(
        json_body(send(&app, Method::GET, "/stats/series").await).await,
        json!({"first_second": 0, "arrivals": [1, 1]})
    );
}

#[tokio::test(start_paused = true)]
async fn the_series_keeps_the_last_hour() {
    let (app, handle) = mock(10, 0, 0);
    let start = Instant::now();
    hit(&app).await;
    tokio::time::advance(Duration::from_secs(mock::SERIES_SECONDS + 10) - start.elapsed()).await;
    hit(&app).await;
    hit(&app).await;
    let series = handle.series();
    assert_eq!(series.first_second, 11);
    assert_eq!(series.arrivals.len() as u64, mock::SERIES_SECONDS);
    assert_eq!(
        series.arrivals.iter().sum::<u64>(),
        2,
        "second 0 was dropped"
    );
    assert_eq!(series.arrivals.last(), Some(&2));

    // Long after: only zeros, still one hour of them.
    tokio::time::advance(Duration::from_secs(5 * mock::SERIES_SECONDS)).await;
    let series = handle.series();
    assert_eq!(series.arrivals.len() as u64, mock::SERIES_SECONDS);
    assert_eq!(series.arrivals.iter().sum::<u64>(), 0);
    assert_eq!(
        series.first_second + mock::SERIES_SECONDS - 1,
        6 * mock::SERIES_SECONDS + 10
    );
}

#[test]
fn the_parser_reads_every_flag_and_has_defaults() {
    let none: [&str; 0] = [];
    assert_eq!(
        parse_args(none),
        Ok(Command::Serve {
            listen: "127.0.0.1:3300".parse().unwrap(),
            config: MockConfig {
                limit: NonZeroU32::new(300).unwrap(),
                latency: Duration::from_millis(5),
                capacity: None,
                fail_every: None,
            },
        })
    );
    let args = [
        "--listen",
        "0.0.0.0:9000",
        "--limit=50",
        "--latency-ms",
        "0",
        "--fail-every",
        "4",
    ];
    assert_eq!(
        parse_args(args),
        Ok(Command::Serve {
            listen: "0.0.0.0:9000".parse().unwrap(),
            config: MockConfig {
                limit: NonZeroU32::new(50).unwrap(),
                latency: Duration::ZERO,
                capacity: None,
                fail_every: NonZeroU64::new(4),
            },
        })
    );
    assert_eq!(
        parse_args(["--fail-every", "0"]).map(|c| match c {
            Command::Serve { config, .. } => config.fail_every,
            Command::Help => panic!("not help"),
        }),
        Ok(None)
    );
    assert_eq!(parse_args(["--help"]), Ok(Command::Help));
    let capacity = |args: &[&str]| match parse_args(args.iter().copied()) {
        Ok(Command::Serve { config, .. }) => config.capacity,
        other => panic!("{other:?}"),
    };
    assert_eq!(capacity(&["--capacity", "2"]), NonZeroU32::new(2));
    assert_eq!(capacity(&["--capacity=0"]), None);
    assert_eq!(capacity(&[]), None);
    assert!(mock::USAGE.contains("--capacity C"));
}

#[test]
fn the_parser_refuses_a_bad_value_naming_the_flag() {
    let cases: [&[&str]; 12] = [
        &["--capacity", "-1"],
        &["--capacity", "4294967296"],
        &["--latency-ms", "3600001"],
        &["--limit", "abc"],
        &["--limit", "0"],
        &["--limit=-1"],
        &["--latency-ms", "-5"],
        &["--latency-ms", "5ms"],
        &["--fail-every", "x"],
        &["--listen", "nope"],
        &["--limit"],
        &["--latency-ms", "5", "--bogus"],
    ];
    for args in cases {
        let err: ArgError = parse_args(args.iter().copied()).unwrap_err();
        let flag = args
            .iter()
            .rev()
            .find(|a| a.starts_with("--"))
            .map(|a| a.split('=').next().unwrap())
            .unwrap();
        assert_eq!(err.flag, flag, "{args:?}");
        let message = err.to_string();
        assert!(
            message.starts_with(&format!("{flag}: ")),
            "{args:?}: {message}"
        );
        assert!(message.len() > flag.len() + 10, "{args:?}: {message}");
    }
    let err = parse_args(["--limit", "0"]).unwrap_err();
    assert!(err.reason.contains("from 1"), "{err}");
}

// ---- capacity: the sharing model on a manual clock, then through the router

mod sharing {
    use super::mock::capacity::{Nanos, Sharing};
    use std::num::NonZeroU32;

    const MS: Nanos = 1_000_000;

    fn capacity(c: u32) -> Option<NonZeroU32> {
        NonZeroU32::new(c)
    }

    #[test]
    fn four_together_on_a_capacity_of_two_each_take_twice_the_latency() {
        let mut model = Sharing::new(capacity(2), 0);
        let tickets: Vec<_> = (0..4).map(|_| model.arrive(20 * MS, 0)).collect();
        assert_eq!(model.in_flight(), 4);
        for &t in &tickets {
            assert_eq!(model.done_at(t), 40 * MS);
        }
        model.advance(40 * MS - 1);
        assert!(tickets.iter().all(|&t| !model.is_done(t)));
        assert_eq!(model.in_flight(), 4);
        model.advance(40 * MS);
        assert!(tickets.iter().all(|&t| model.is_done(t)));
        assert_eq!(model.in_flight(), 0);
    }

    #[test]
    fn within_the_capacity_or_unlimited_each_takes_the_latency() {
        for (c, n) in [(4, 4), (4, 1), (0, 100)] {
            let mut model = Sharing::new(capacity(c), 5 * MS);
            let tickets: Vec<_> = (0..n).map(|_| model.arrive(20 * MS, 5 * MS)).collect();
            for &t in &tickets {
                assert_eq!(model.done_at(t), 25 * MS, "capacity {c}, {n} in flight");
            }
            model.advance(25 * MS);
            assert_eq!(model.in_flight(), 0, "capacity {c}, {n} in flight");
        }
    }

    #[test]
    fn a_later_arrival_slows_the_first_from_its_instant_only() {
        // Capacity 1, 20 ms each: A alone for 10 ms (10 ms of work), then
        // both at half speed: A needs 10 more, done at 30 ms; B has 10 by
        // then and needs 10 more alone, done at 40 ms.
        let mut model = Sharing::new(capacity(1), 0);
        let a = model.arrive(20 * MS, 0);
        assert_eq!(model.done_at(a), 20 * MS);
        let b = model.arrive(20 * MS, 10 * MS);
        assert_eq!(model.done_at(a), 30 * MS);
        assert_eq!(model.done_at(b), 40 * MS);
        model.advance(30 * MS);
        assert!(model.is_done(a));
        assert!(!model.is_done(b));
        assert_eq!(model.in_flight(), 1);
        model.advance(40 * MS - 1);
        assert!(!model.is_done(b));
        model.advance(40 * MS);
        assert!(model.is_done(b));
    }

    #[test]
    fn a_departure_speeds_up_the_rest_and_the_projection_counts_it() {
        // Capacity 1: A (10 ms) and B (30 ms) share until A is done at 20 ms;
        // B then has 10 ms of work and needs 20 ms more alone.
        let mut model = Sharing::new(capacity(1), 0);
        let a = model.arrive(10 * MS, 0);
        let b = model.arrive(30 * MS, 0);
        assert_eq!(model.done_at(a), 20 * MS);
        assert_eq!(model.done_at(b), 40 * MS);
        // One advance past both completions takes each at its own instant.
        model.advance(40 * MS);
        assert!(model.is_done(a) && model.is_done(b));
    }

    #[test]
    fn a_capacity_change_applies_to_the_work_left() {
        // Capacity 1, two of 20 ms: 5 ms of work each by 10 ms; capacity 2
        // then serves the 15 ms left at full speed: done at 25 ms.
        let mut model = Sharing::new(capacity(1), 0);
        let a = model.arrive(20 * MS, 0);
        let b = model.arrive(20 * MS, 0);
        model.set_capacity(capacity(2), 10 * MS);
        assert_eq!(model.capacity(), capacity(2));
        assert_eq!(model.done_at(a), 25 * MS);
        assert_eq!(model.done_at(b), 25 * MS);
        // And back down to 1 at 15 ms: 10 ms left each, at half speed.
        model.set_capacity(capacity(1), 15 * MS);
        assert_eq!(model.done_at(b), 35 * MS);
        // Unlimited again at 20 ms: 7.5 ms left, at full speed.
        model.set_capacity(None, 20 * MS);
        assert_eq!(model.done_at(a), 27 * MS + MS / 2);
    }

    #[test]
    fn a_request_that_leaves_early_frees_its_share() {
        let mut model = Sharing::new(capacity(1), 0);
        let a = model.arrive(20 * MS, 0);
        let b = model.arrive(20 * MS, 0);
        assert!(model.cancel(a, 10 * MS));
        assert_eq!(model.in_flight(), 1);
        assert_eq!(model.done_at(b), 25 * MS);
        model.advance(25 * MS);
        assert!(model.is_done(b));
        // A request already done is not in flight any more.
        assert!(!model.cancel(b, 30 * MS));
        assert_eq!(model.in_flight(), 0);

        // Within the capacity, or unlimited, a departure speeds up no one.
        for c in [2, 0] {
            let mut model = Sharing::new(capacity(c), 0);
            let a = model.arrive(20 * MS, 0);
            let b = model.arrive(20 * MS, 0);
            assert!(!model.cancel(a, 10 * MS), "capacity {c}");
            assert_eq!(model.in_flight(), 1, "capacity {c}");
            assert_eq!(model.done_at(b), 20 * MS, "capacity {c}");
        }
    }

    #[test]
    fn uneven_shares_round_the_completion_up_to_the_nanosecond() {
        // 7 of 10 ms on a capacity of 3: 70/3 ms = 23_333_333.3 ns.
        let mut model = Sharing::new(capacity(3), 0);
        let tickets: Vec<_> = (0..7).map(|_| model.arrive(10 * MS, 0)).collect();
        assert_eq!(model.done_at(tickets[6]), 23_333_334);
        model.advance(23_333_333);
        assert_eq!(model.in_flight(), 7);
        model.advance(23_333_334);
        assert_eq!(model.in_flight(), 0);

        // Reading the model often between events loses no work.
        let mut model = Sharing::new(capacity(3), 0);
        let tickets: Vec<_> = (0..7).map(|_| model.arrive(10 * MS, 0)).collect();
        let mut now = 0;
        while !model.is_done(tickets[0]) {
            now += 7;
            model.advance(now);
        }
        assert_eq!(now, 23_333_334 + 4); // the first multiple of 7 after it
        assert_eq!(model.in_flight(), 0);
    }

    #[test]
    fn zero_work_is_done_at_once_and_never_in_flight() {
        let mut model = Sharing::new(capacity(1), 0);
        let busy = model.arrive(10 * MS, 0);
        let instant = model.arrive(0, 3 * MS);
        assert!(model.is_done(instant));
        assert_eq!(model.in_flight(), 1);
        assert_eq!(model.done_at(busy), 10 * MS);
    }
}

fn mock_with(limit: u32, latency_ms: u64, capacity: u32) -> (Router, MockHandle) {
    mock::router(MockConfig {
        limit: NonZeroU32::new(limit).unwrap(),
        latency: Duration::from_millis(latency_ms),
        capacity: NonZeroU32::new(capacity),
        fail_every: None,
    })
}

/// Sends one arrival on its own task; the task returns its status and how
/// long it took.
fn spawn_timed(app: &Router) -> tokio::task::JoinHandle<(StatusCode, Duration)> {
    let app = app.clone();
    tokio::spawn(async move {
        let start = Instant::now();
        let status = hit(&app).await;
        (status, start.elapsed())
    })
}

#[tokio::test(start_paused = true)]
async fn four_concurrent_on_a_capacity_of_two_each_take_40_ms() {
    let (app, handle) = mock_with(100, 20, 2);
    let tasks: Vec<_> = (0..4).map(|_| spawn_timed(&app)).collect();
    for task in tasks {
        assert_eq!(
            task.await.unwrap(),
            (StatusCode::OK, Duration::from_millis(40))
        );
    }
    let stats = handle.stats();
    assert_eq!((stats.max_concurrent, stats.total), (4, 4));
    assert_eq!((stats.p50_ms, stats.p99_ms), (Some(40), Some(40)));

    // Two at once are within the capacity: 20 ms each.
    let tasks: Vec<_> = (0..2).map(|_| spawn_timed(&app)).collect();
    for task in tasks {
        assert_eq!(
            task.await.unwrap(),
            (StatusCode::OK, Duration::from_millis(20))
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_later_arrival_shares_the_capacity_from_its_instant() {
    let (app, _handle) = mock_with(100, 20, 1);
    let a = spawn_timed(&app);
    tokio::time::sleep(Duration::from_millis(10)).await;
    let b = spawn_timed(&app);
    // A: 10 ms alone, then 10 ms of work at half speed: 30 ms. B: 10 ms of
    // work by then at half speed, 10 more alone: 30 ms.
    assert_eq!(a.await.unwrap().1, Duration::from_millis(30));
    assert_eq!(b.await.unwrap().1, Duration::from_millis(30));
}

#[tokio::test(start_paused = true)]
async fn raising_the_capacity_speeds_up_the_requests_in_flight() {
    let (app, _handle) = mock_with(100, 20, 1);
    let tasks: Vec<_> = (0..2).map(|_| spawn_timed(&app)).collect();
    tokio::time::sleep(Duration::from_millis(10)).await;
    let response = post_json(&app, "/config", r#"{"capacity": 2}"#).await;
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    // 5 ms of work each by 10 ms, the 15 left at full speed.
    for task in tasks {
        assert_eq!(task.await.unwrap().1, Duration::from_millis(25));
    }
}

#[tokio::test(start_paused = true)]
async fn a_request_dropped_in_flight_frees_its_share() {
    let (app, handle) = mock_with(100, 20, 1);
    let dropped = spawn_timed(&app);
    let kept = spawn_timed(&app);
    tokio::time::sleep(Duration::from_millis(10)).await;
    dropped.abort();
    assert!(dropped.await.unwrap_err().is_cancelled());
    assert_eq!(kept.await.unwrap().1, Duration::from_millis(25));
    // Only the answered one has a latency.
    let stats = handle.stats();
    assert_eq!(
        (stats.total, stats.p50_ms, stats.p99_ms),
        (2, Some(25), Some(25))
    );
}

// ---- /config

async fn post_json(app: &Router, uri: &str, body: &str) -> Response {
    let request = Request::builder()
        .method(Method::POST)
        .uri(uri)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap();
    app.clone().oneshot(request).await.unwrap()
}

async fn config(app: &Router) -> Value {
    let response = send(app, Method::GET, "/config").await;
    assert_eq!(response.status(), StatusCode::OK);
    json_body(response).await
}

#[tokio::test(start_paused = true)]
async fn config_round_trips_and_is_not_an_arrival() {
    let (app, handle) = mock(300, 5, 0);
    assert_eq!(
        config(&app).await,
        json!({"limit": 300, "latency_ms": 5, "capacity": 0, "fail_every": 0})
    );
    let response = post_json(
        &app,
        "/config",
        r#"{"limit": 150, "latency_ms": 7, "capacity": 3, "fail_every": 4}"#,
    )
    .await;
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    assert_eq!(
        config(&app).await,
        json!({"limit": 150, "latency_ms": 7, "capacity": 3, "fail_every": 4})
    );
    assert_eq!(
        handle.config(),
        MockConfig {
            limit: NonZeroU32::new(150).unwrap(),
            latency: Duration::from_millis(7),
            capacity: NonZeroU32::new(3),
            fail_every: NonZeroU64::new(4),
        }
    );
    // A partial object changes only its fields; 0 turns capacity and
    // fail_every off again.
    let response = post_json(&app, "/config", r#"{"capacity": 0, "fail_every": 0}"#).await;
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    assert_eq!(
        config(&app).await,
        json!({"limit": 150, "latency_ms": 7, "capacity": 0, "fail_every": 0})
    );
    let response = post_json(&app, "/config", "{}").await;
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    assert_eq!(config(&app).await["limit"], 150);
    assert_eq!(handle.stats().total, 0, "control paths are not arrivals");
}

#[tokio::test(start_paused = true)]
async fn a_bad_field_is_a_400_problem_naming_it_and_changes_nothing() {
    let (app, _handle) = mock(300, 5, 0);
    let response = post_json(&app, "/config", r#"{"limit": 150, "limt": 10}"#).await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let problem = json_body(response).await;
    assert_eq!(problem["type"], "about:blank");
    assert_eq!(problem["title"], "Bad Request");
    assert_eq!(problem["status"], 400);
    assert_eq!(
        problem["detail"],
        "limt: unknown setting; known are limit, latency_ms, capacity, fail_every"
    );
    assert_eq!(
        problem["errors"],
        json!([{"name": "limt", "reason": "unknown setting; known are limit, latency_ms, capacity, fail_every"}])
    );
    // All or nothing: the good field in the same body was not applied.
    assert_eq!(config(&app).await["limit"], 300);

    let cases = [
        (r#"{"limit": 0}"#, "limit", "0"),
        (r#"{"limit": -1}"#, "limit", "-1"),
        (r#"{"limit": "10"}"#, "limit", "\"10\""),
        (r#"{"limit": 4294967296}"#, "limit", "4294967296"),
        (r#"{"latency_ms": 3600001}"#, "latency_ms", "3600001"),
        (r#"{"latency_ms": 1.5}"#, "latency_ms", "1.5"),
        (r#"{"capacity": -2}"#, "capacity", "-2"),
        (r#"{"capacity": 4294967296}"#, "capacity", "4294967296"),
        (r#"{"fail_every": null}"#, "fail_every", "null"),
        (r#"{"fail_every": true}"#, "fail_every", "true"),
    ];
    for (body, field, shown) in cases {
        let response = post_json(&app, "/config", body).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{body}");
        let problem = json_body(response).await;
        assert_eq!(problem["status"], 400, "{body}");
        assert_eq!(problem["errors"].as_array().unwrap().len(), 1, "{body}");
        assert_eq!(problem["errors"][0]["name"], field, "{body}");
        let detail = problem["detail"].as_str().unwrap();
        assert!(
            detail.starts_with(&format!("{field}: {shown} is not a whole number")),
            "{body}: {detail}"
        );
    }
    assert_eq!(
        json_body(post_json(&app, "/config", r#"{"limit": 0}"#).await).await["detail"],
        "limit: 0 is not a whole number of arrivals per second from 1 to 4294967295"
    );
    // Two bad fields: both named.
    let problem =
        json_body(post_json(&app, "/config", r#"{"capacity": -1, "limit": 0}"#).await).await;
    let mut names: Vec<_> = problem["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap().to_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["capacity", "limit"]);

    // Not an object: 400 without field errors.
    for body in ["[1]", "nope", ""] {
        let response = post_json(&app, "/config", body).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{body:?}");
        let problem = json_body(response).await;
        assert_eq!(problem["status"], 400, "{body:?}");
        assert!(problem.get("errors").is_none(), "{body:?}");
    }
    assert_eq!(
        config(&app).await,
        json!({"limit": 300, "latency_ms": 5, "capacity": 0, "fail_every": 0})
    );
}

#[tokio::test(start_paused = true)]
async fn a_limit_dropped_from_300_to_150_refuses_from_the_next_arrival() {
    let (app, handle) = mock(300, 0, 0);
    let t0 = Instant::now();
    let responses = burst(&app, 200).await;
    assert_eq!(count(&responses, StatusCode::OK), 200);
    let response = post_json(&app, "/config", r#"{"limit": 150}"#).await;
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    // The window (t - 1 s, t] already holds 200: every arrival is over 150.
    let responses = burst(&app, 10).await;
    assert_eq!(count(&responses, StatusCode::TOO_MANY_REQUESTS), 10);
    tokio::time::advance(Duration::from_millis(999)).await;
    assert_eq!(hit(&app).await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(handle.stats().rejected, 11);

    // At t0 + 1 s the burst at t0 has left; the refused arrival at 999 ms has
    // not, so 149 more are admitted and the rest of 160 refused.
    tokio::time::advance(t0 + WINDOW - Instant::now()).await;
    let responses = burst(&app, 160).await;
    assert_eq!(count(&responses, StatusCode::OK), 149);
    assert_eq!(count(&responses, StatusCode::TOO_MANY_REQUESTS), 11);
    let stats = handle.stats();
    assert_eq!((stats.total, stats.rejected), (371, 22));

    // Raised back to 300 at the same instant: 300 - 161 = 139 more.
    post_json(&app, "/config", r#"{"limit": 300}"#).await;
    let responses = burst(&app, 150).await;
    assert_eq!(count(&responses, StatusCode::OK), 139);
    assert_eq!(count(&responses, StatusCode::TOO_MANY_REQUESTS), 11);
}

#[tokio::test(start_paused = true)]
async fn a_new_latency_is_the_work_of_later_arrivals_only() {
    let (app, _handle) = mock(100, 20, 0);
    let first = spawn_timed(&app);
    tokio::time::sleep(Duration::from_millis(10)).await;
    post_json(&app, "/config", r#"{"latency_ms": 50}"#).await;
    let second = spawn_timed(&app);
    assert_eq!(first.await.unwrap().1, Duration::from_millis(20));
    assert_eq!(second.await.unwrap().1, Duration::from_millis(50));
}

#[tokio::test(start_paused = true)]
async fn a_new_fail_every_counts_the_accepted_arrivals_so_far() {
    let (app, _handle) = mock(100, 0, 0);
    let (ok, failed) = (StatusCode::OK, StatusCode::SERVICE_UNAVAILABLE);
    for _ in 0..3 {
        assert_eq!(hit(&app).await, ok);
    }
    post_json(&app, "/config", r#"{"fail_every": 2}"#).await;
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(hit(&app).await);
    }
    // The 4th, 5th, 6th and 7th accepted.
    assert_eq!(statuses, [failed, ok, failed, ok]);
}

// ---- latency percentiles

mod percentiles {
    use super::mock::stats::{Latencies, HISTOGRAM_MS};
    use std::time::Duration;

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn nearest_rank_on_one_to_a_hundred() {
        let mut latencies = Latencies::default();
        assert_eq!(latencies.percentile(50), None);
        for i in (1..=100).rev() {
            latencies.record(ms(i));
        }
        assert_eq!(latencies.count(), 100);
        assert_eq!(latencies.percentile(50), Some(50));
        assert_eq!(latencies.percentile(99), Some(99));
        assert_eq!(latencies.percentile(100), Some(100));
        assert_eq!(latencies.percentile(1), Some(1));
    }

    #[test]
    fn small_sets_and_whole_milliseconds_rounded_down() {
        let mut latencies = Latencies::default();
        latencies.record(Duration::from_micros(7_999));
        assert_eq!(latencies.percentile(50), Some(7));
        assert_eq!(latencies.percentile(99), Some(7));
        // 7, 8, 9: the median is the 2nd, the 99th the 3rd.
        latencies.record(ms(9));
        latencies.record(Duration::from_nanos(8_000_001));
        assert_eq!(latencies.percentile(50), Some(8));
        assert_eq!(latencies.percentile(99), Some(9));
        // 0 ms is a latency too.
        let mut zero = Latencies::default();
        zero.record(Duration::ZERO);
        assert_eq!(zero.percentile(99), Some(0));
    }

    #[test]
    fn a_hundred_answers_with_one_slow_one() {
        let mut latencies = Latencies::default();
        for _ in 0..99 {
            latencies.record(ms(5));
        }
        latencies.record(ms(HISTOGRAM_MS - 1));
        assert_eq!(latencies.percentile(50), Some(5));
        assert_eq!(latencies.percentile(99), Some(5));
        assert_eq!(latencies.percentile(100), Some(HISTOGRAM_MS - 1));
    }

    #[test]
    fn beyond_the_histogram_the_largest_seen_is_reported() {
        let mut latencies = Latencies::default();
        for _ in 0..98 {
            latencies.record(ms(3));
        }
        latencies.record(ms(HISTOGRAM_MS));
        latencies.record(ms(25_000));
        assert_eq!(latencies.percentile(98), Some(3));
        // The 99th is 10 s, in the overflow bucket with 25 s: reported as
        // 25 s, the largest seen.
        assert_eq!(latencies.percentile(99), Some(25_000));
        assert_eq!(latencies.percentile(100), Some(25_000));
    }

    #[test]
    fn memory_does_not_grow_with_the_answers() {
        let mut latencies = Latencies::default();
        assert_eq!(latencies.buckets(), HISTOGRAM_MS as usize + 1);
        for i in 0..100_000u64 {
            latencies.record(ms(i % 20_000));
        }
        assert_eq!(latencies.count(), 100_000);
        assert_eq!(latencies.buckets(), HISTOGRAM_MS as usize + 1);
        // Half of them are at or over 10 s: the median is the first of those.
        assert_eq!(latencies.percentile(50), Some(HISTOGRAM_MS - 1));
        assert_eq!(latencies.percentile(51), Some(19_999));
    }
}

#[tokio::test(start_paused = true)]
async fn stats_report_exact_percentiles_of_the_answered_latencies() {
    let (app, handle) = mock(100, 10, 0);
    for _ in 0..9 {
        assert_eq!(hit(&app).await, StatusCode::OK);
    }
    post_json(&app, "/config", r#"{"latency_ms": 100}"#).await;
    assert_eq!(hit(&app).await, StatusCode::OK);
    // Ten answers: the 5th is 10 ms, the 10th (rank ceil(9.9)) is 100 ms.
    let stats = stats(&app).await;
    assert_eq!(
        (&stats["p50_ms"], &stats["p99_ms"]),
        (&json!(10), &json!(100))
    );

    // Refused arrivals are answered too, after the same work.
    post_json(&app, "/config", r#"{"limit": 1, "latency_ms": 30}"#).await;
    let responses = burst(&app, 10).await;
    assert_eq!(count(&responses, StatusCode::TOO_MANY_REQUESTS), 10);
    // 20 answers: 9 × 10 ms, 1 × 100 ms, 10 × 30 ms.
    assert_eq!(
        (handle.stats().p50_ms, handle.stats().p99_ms),
        (Some(30), Some(100))
    );

    // A reset forgets them.
    handle.reset();
    assert_eq!((handle.stats().p50_ms, handle.stats().p99_ms), (None, None));
}
