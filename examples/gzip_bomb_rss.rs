//! Runs a gzip bomb (about 1 MiB that inflates to 1 GiB) through
//! `BodyLimitsLayer` in-process and prints the peak resident set size
//! (`VmHWM`, Linux only) before and after, so the memory the bomb costs can
//! be read off.
//!
//! ```text
//! cargo run --release --example gzip_bomb_rss
//! ```
//!
//! Three runs: a streaming handler that keeps nothing (what decompression
//! and the caps cost on their own), then axum's `Bytes` extractor, the worst
//! case, which buffers everything it is given up to the decoded cap, with an
//! 8 MiB and then a 64 MiB cap: the peak follows the cap, not the 1 GiB the
//! bomb would inflate to.

use std::io::Write;

use axum::body::{Body, Bytes};
use axum::http::{header, Request};
use axum::routing::post;
use axum::Router;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_admission::bounds::BodyLimitsLayer;

const MIB: usize = 1024 * 1024;

/// A peak-RSS figure from `/proc/self/status`, in KiB.
fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn gzip_zeros(decoded: usize) -> Vec<u8> {
    let zeros = vec![0u8; MIB];
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let mut left = decoded;
    while left > 0 {
        let n = left.min(MIB);
        enc.write_all(&zeros[..n]).expect("write to a Vec");
        left -= n;
    }
    enc.finish().expect("finish a Vec")
}

async fn buffer_all(body: Bytes) -> String {
    body.len().to_string()
}

/// Reads the body frame by frame and keeps nothing: what decompression and
/// the caps cost on their own.
async fn stream_through(body: Body) -> String {
    let mut body = body;
    let mut total = 0usize;
    while let Some(Ok(frame)) = body.frame().await {
        total += frame.data_ref().map_or(0, Bytes::len);
    }
    total.to_string()
}

async fn run(bomb: &Bytes, decoded_cap: usize, buffered: bool) -> u16 {
    let app = Router::new()
        .route("/stream", post(stream_through))
        .route("/buffer", post(buffer_all))
        .layer(BodyLimitsLayer::new(2 * MIB, decoded_cap));
    let len = bomb.len();
    let bomb = bomb.clone();
    let chunks = (0..len.div_ceil(16 * 1024)).map(move |i| {
        Ok::<_, std::io::Error>(bomb.slice(i * 16 * 1024..((i + 1) * 16 * 1024).min(len)))
    });
    let req = Request::post(if buffered { "/buffer" } else { "/stream" })
        .header(header::CONTENT_ENCODING, "gzip")
        .body(Body::from_stream(futures_util::stream::iter(chunks)))
        .expect("valid request");
    let response = app.oneshot(req).await.expect("infallible");
    response.status().as_u16()
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let bomb = Bytes::from(gzip_zeros(1024 * MIB));
    println!(
        "bomb: {} bytes on the wire, 1073741824 bytes decoded",
        bomb.len()
    );
    let before = status_kib("VmHWM:");
    println!(
        "VmHWM before:             {before} KiB (VmRSS {} KiB)",
        status_kib("VmRSS:")
    );
    for (cap, buffered) in [(8 * MIB, false), (8 * MIB, true), (64 * MIB, true)] {
        let start = status_kib("VmHWM:");
        let status = run(&bomb, cap, buffered).await;
        let after = status_kib("VmHWM:");
        println!(
            "decoded cap {:>3} MiB, {}: status {status}, VmHWM {after} KiB, growth {} KiB",
            cap / MIB,
            if buffered {
                "Bytes extractor  "
            } else {
                "streaming handler"
            },
            after.saturating_sub(start)
        );
    }
    println!(
        "total VmHWM growth: {} KiB",
        status_kib("VmHWM:").saturating_sub(before)
    );
}
