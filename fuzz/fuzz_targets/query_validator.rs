//! Fuzzes `QueryRules::validate`, the pure query-string validator behind
//! `ValidateQueryLayer`.
//!
//! Run from the repository root:
//!
//! ```text
//! cargo +nightly fuzz run query_validator -- -max_total_time=60
//! ```
//!
//! Input: byte 0 picks the rules (bit 0: unknown parameters rejected or
//! ignored; bit 1: with or without a 31-day span limit); the rest, read as
//! UTF-8 with replacement, is the raw query string. Checked: no panic; an
//! accepted query satisfies every rule; a refused one names at least one
//! parameter, each at most once.
#![no_main]

use std::collections::HashSet;
use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use tower_admission::bounds::QueryRules;

const MAX_PAGE: u32 = 1000;
const MAX_CURSOR: usize = 64;
const SPAN_SECS: u64 = 31 * 24 * 3600;

fn rules(selector: u8) -> QueryRules {
    let rules = QueryRules::new()
        .page_size(
            NonZeroU32::new(50).expect("non-zero"),
            NonZeroU32::new(MAX_PAGE).expect("non-zero"),
        )
        .expect("valid page sizes")
        .max_cursor_len(NonZeroUsize::new(MAX_CURSOR).expect("non-zero"))
        .allow("sort")
        .expect("valid name")
        .ignore_unknown_params(selector & 1 != 0);
    if selector & 2 == 0 {
        return rules
            .max_span(Duration::from_secs(SPAN_SECS))
            .expect("valid span");
    }
    rules
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let rules = rules(selector);
    let query = String::from_utf8_lossy(rest);
    match rules.validate(Some(&query)) {
        Ok(q) => {
            assert!((1..=MAX_PAGE).contains(&q.page_size));
            if let (Some(from), Some(to)) = (q.from, q.to) {
                assert!(from < to);
                if selector & 2 == 0 {
                    assert!((to - from).whole_seconds() <= SPAN_SECS as i64);
                }
            } else if selector & 2 == 0 {
                // With a span limit, both ends or neither.
                assert_eq!(q.from.is_some(), q.to.is_some());
            }
            if let Some(cursor) = &q.cursor {
                assert!(!cursor.is_empty() && cursor.len() <= MAX_CURSOR);
                assert!(cursor.bytes().all(|b| b.is_ascii_graphic()));
            }
        }
        Err(errors) => {
            assert!(!errors.is_empty());
            let mut names = HashSet::new();
            for e in &errors {
                assert!(!e.reason.is_empty());
                assert!(names.insert(e.name.as_str()), "{} listed twice", e.name);
            }
        }
    }
});
