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
}

#[test]
fn the_parser_refuses_a_bad_value_naming_the_flag() {
    let cases: [&[&str]; 9] = [
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
