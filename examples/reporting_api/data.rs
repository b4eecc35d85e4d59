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
        let at = from + Duration::hours(index as i64);
        if at >= to {
            return (rows, None);
        }
        rows.push(Row {
            metric: metric.to_owned(),
            at: at
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default(),
            value: (index * 7919 + metric.len() as u64 * 31) % 1000,
        });
        index += 1;
    }
    (rows, Some(index))
}
