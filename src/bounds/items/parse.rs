//! The batch parser: items counted as the array is read.

use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use crate::reject::{InvalidParameter, Rejection};

/// Where the parser was when it failed.
#[derive(Debug, Clone, Copy)]
enum At {
    Outside,
    Item(usize),
    OverCap,
}

/// Parses a batch `{"items": [...]}`, refusing it once the array has more
/// than `max` items; see [`BatchItemsLayer::parse`](super::BatchItemsLayer::parse).
pub(crate) fn parse_batch<T>(json: &[u8], max: usize) -> Result<Vec<T>, Rejection>
where
    T: for<'de> Deserialize<'de>,
{
    let at = Cell::new(At::Outside);
    let mut de = serde_json::Deserializer::from_slice(json);
    let seed = Envelope {
        max,
        at: &at,
        item: PhantomData::<T>,
    };
    let result = seed.deserialize(&mut de).and_then(|items| {
        de.end()?;
        Ok(items)
    });
    result.map_err(|err| match at.get() {
        At::OverCap => Rejection::TooManyItems {
            limit: u64::try_from(max).unwrap_or(u64::MAX),
        },
        At::Item(i) => Rejection::InvalidParameters(vec![InvalidParameter::new(
            format!("items[{i}]"),
            err.to_string(),
        )]),
        At::Outside => {
            Rejection::InvalidParameters(vec![InvalidParameter::new("body", err.to_string())])
        }
    })
}

/// The number of items of a batch, without building them; errors as
/// [`parse_batch`].
pub(crate) fn count_batch_items(json: &[u8], max: usize) -> Result<usize, Rejection> {
    parse_batch::<IgnoredAny>(json, max).map(|items| items.len())
}

struct Envelope<'a, T> {
    max: usize,
    at: &'a Cell<At>,
    item: PhantomData<T>,
}

impl<'de, T: Deserialize<'de>> DeserializeSeed<'de> for Envelope<'_, T> {
    type Value = Vec<T>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Vec<T>, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for Envelope<'_, T> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(r#"an object {"items": [...]}"#)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Vec<T>, A::Error> {
        let mut items = None;
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Items if items.is_some() => return Err(de::Error::duplicate_field("items")),
                Key::Items => {
                    items = Some(map.next_value_seed(ItemsSeed {
                        max: self.max,
                        at: self.at,
                        item: PhantomData::<T>,
                    })?);
                }
                Key::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        items.ok_or_else(|| de::Error::missing_field("items"))
    }
}

enum Key {
    Items,
    Other,
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl Visitor<'_> for KeyVisitor {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a member name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(if v == "items" { Key::Items } else { Key::Other })
            }
        }
        deserializer.deserialize_identifier(KeyVisitor)
    }
}

struct ItemsSeed<'a, T> {
    max: usize,
    at: &'a Cell<At>,
    item: PhantomData<T>,
}

impl<'de, T: Deserialize<'de>> DeserializeSeed<'de> for ItemsSeed<'_, T> {
    type Value = Vec<T>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Vec<T>, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for ItemsSeed<'_, T> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "an array of at most {} items", self.max)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        // Never trust a size hint for a pre-allocation beyond the cap.
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(self.max).min(1024));
        loop {
            if out.len() == self.max {
                // One more element (skipped, never built) means over the cap.
                self.at.set(At::Item(out.len()));
                if seq.next_element::<IgnoredAny>()?.is_some() {
                    self.at.set(At::OverCap);
                    return Err(de::Error::custom(format_args!(
                        "more than {} items",
                        self.max
                    )));
                }
                break;
            }
            self.at.set(At::Item(out.len()));
            match seq.next_element::<T>()? {
                Some(item) => out.push(item),
                None => break,
            }
        }
        self.at.set(At::Outside);
        Ok(out)
    }
}
