//! Fake report rows, generated deterministically.

use serde::Serialize;
use time::{Duration, OffsetDateTime};

/// One row of a report.
#[derive(Debug, Serialize)]
pub(crate) struct Row {
    pub(crate) metric: String,
    pub(crate) at: String,
    pub(crate) value: u64,
}

/// A page of `page_size` rows from `from`, one per hour, starting after `cursor`.
///
/// Row `i` is at `from + i` hours, and only rows before `to` exist. A cursor
/// at or past the end (however large) gives an empty page with no next
/// cursor; so does a row whose time `OffsetDateTime` cannot hold, which is
/// past any `to`. Nothing here overflows.
pub(crate) fn page(
    metric: &str,
    from: OffsetDateTime,
    to: OffsetDateTime,
    page_size: u32,
    cursor: u64,
) -> (Vec<Row>, Option<u64>) {
    let mut rows = Vec::new();
    let mut index = cursor;
    while rows.len() < page_size as usize {
        let Some(at) = row_time(from, index).filter(|at| *at < to) else {
            return (rows, None);
        };
        rows.push(Row {
            metric: metric.to_owned(),
            at: at
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default(),
            // `index % 1000` keeps the value of `index * 7919 % 1000`
            // without overflowing.
            value: ((index % 1000) * 7919 + metric.len() as u64 % 1000 * 31) % 1000,
        });
        let Some(next) = index.checked_add(1) else {
            return (rows, None);
        };
        index = next;
    }
    (rows, Some(index))
}

/// `from + index` hours, or `None` when that is past what `OffsetDateTime`
/// can hold.
fn row_time(from: OffsetDateTime, index: u64) -> Option<OffsetDateTime> {
    let seconds = i64::try_from(index).ok()?.checked_mul(3600)?;
    from.checked_add(Duration::seconds(seconds))
}
