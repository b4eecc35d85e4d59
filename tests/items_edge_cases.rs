//! Batch item counts at their edges, through `BatchItemsLayer::parse` (counting into
//! zero-sized items, as `BatchItemsLayer` does, and building them).

use tower_admission::bounds::BatchItemsLayer;
use tower_admission::reject::Rejection;

/// The item count as `BatchItemsLayer` takes it: `BatchItemsLayer::parse` into
/// zero-sized `IgnoredAny` items.
fn count_batch_items(json: &[u8], max: usize) -> Result<usize, Rejection> {
    BatchItemsLayer::parse::<serde::de::IgnoredAny>(json, max).map(|items| items.len())
}

fn malformed(json: &str, max: usize) -> (String, String) {
    match count_batch_items(json.as_bytes(), max) {
        Err(Rejection::InvalidParameters(mut ps)) if ps.len() == 1 => {
            let p = ps.remove(0);
            (p.name, p.reason)
        }
        other => panic!("{json}: {other:?}"),
    }
}

#[test]
fn counts_at_and_over_the_cap() {
    for (json, n) in [
        (r#"{"items":[]}"#, 0),
        (r#"{"items":[1,2,3]}"#, 3),
        (r#"{"\u0069tems":[1,2,3]}"#, 3),
        (r#"  {"items":[1]}  "#, 1),
        // Only the top-level `items` counts; nested arrays are one item.
        (r#"{"a":{"items":[1,2,3,4,5]},"items":[1]}"#, 1),
        (r#"{"items":[[1,2,3,4,5]]}"#, 1),
    ] {
        assert_eq!(count_batch_items(json.as_bytes(), 3), Ok(n), "{json}");
    }
    for json in [
        r#"{"items":[1,2,3,4]}"#,
        r#"{"items":[1,2,3,4,5,6,7,8]}"#,
        // Over the cap before it is cut off: the cap answers.
        r#"{"items":[1,2,3,4"#,
    ] {
        assert_eq!(
            count_batch_items(json.as_bytes(), 3),
            Err(Rejection::TooManyItems { limit: 3 }),
            "{json}"
        );
    }
    assert_eq!(
        BatchItemsLayer::parse::<u8>(br#"{"items":[1,2,3,300]}"#, 3),
        Err(Rejection::TooManyItems { limit: 3 })
    );
}

#[test]
fn malformed_batches_name_the_body_or_the_item() {
    assert_eq!(malformed(r#"{"items":[1,2,3],"items":[]}"#, 3).0, "body");
    assert_eq!(malformed(r#"{"items":[1,2,3]} x"#, 3).0, "body");
    assert_eq!(malformed(r#"{"items":null}"#, 3).0, "body");
    assert_eq!(malformed("{}", 3).0, "body");
    assert_eq!(malformed("[1,2]", 3).0, "body");
    assert_eq!(malformed("", 3).0, "body");
    assert_eq!(malformed(r#"{"items":[1 2]}"#, 3).0, "items[1]");
    assert_eq!(malformed(r#"{"items":[1,2,3,}"#, 3).0, "items[3]");
    let item = |r: Result<Vec<u64>, Rejection>| match r {
        Err(Rejection::InvalidParameters(mut ps)) if ps.len() == 1 => ps.remove(0).name,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        item(BatchItemsLayer::parse(
            br#"{"items":[18446744073709551616]}"#,
            3
        )),
        "items[0]"
    );
    assert_eq!(
        item(BatchItemsLayer::parse(br#"{"items":[1, -1]}"#, 3)),
        "items[1]"
    );
    assert_eq!(
        item(BatchItemsLayer::parse(br#"{"items":[1, 1.5]}"#, 3)),
        "items[1]"
    );
}
