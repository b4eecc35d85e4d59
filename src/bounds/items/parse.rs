//! The batch parser: items counted as the array is read.

use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use crate::reject::{InvalidParameter, Rejection, SizeCap};

/// Why a batch was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BatchError {
    /// The `items` array holds more than `limit` items. 413.
    TooManyItems {
        /// The cap.
        limit: usize,
    },
    /// The body is not a JSON object with one `items` array of valid items.
    /// 400; `name` is `body`, or `items[i]` for a bad item.
    Malformed(InvalidParameter),
}

impl BatchError {
    /// The rejection to answer with: 413 with cap `items`, or 400.
    pub fn into_rejection(self) -> Rejection {
        match self {
            BatchError::TooManyItems { limit } => Rejection::PayloadTooLarge {
                cap: SizeCap::Items,
                limit: u64::try_from(limit).unwrap_or(u64::MAX),
            },
            BatchError::Malformed(param) => Rejection::InvalidParameters(vec![param]),
        }
    }
}

impl fmt::Display for BatchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BatchError::TooManyItems { limit } => write!(f, "more than {limit} items"),
            BatchError::Malformed(p) => write!(f, "{}: {}", p.name, p.reason),
        }
    }
}

impl std::error::Error for BatchError {}

/// Where the parser was when it failed.
#[derive(Debug, Clone, Copy)]
enum At {
    Outside,
    Item(usize),
    OverCap,
}

/// Parses a batch `{"items": [...]}`, refusing it once the array has more
/// than `max` items.
///
/// The count is checked while the array is read: the parser stops at the
/// first item past the cap, so at most `max` values of `T` are ever built,
/// and a refused batch builds none that reach the caller. Other members of
/// the object are ignored; a second `items` member is refused.
///
/// Counting only, without building items: `parse_batch::<IgnoredAny>`
/// (`serde::de::IgnoredAny`, a zero-sized type, so the returned `Vec` does
/// not allocate), which is what [`BatchItemsLayer`](crate::bounds::BatchItemsLayer) does.
///
/// ```
/// use tower_admission::bounds::{parse_batch, BatchError};
///
/// let ok: Vec<u32> = parse_batch(br#"{"items":[1,2,3]}"#, 3).unwrap();
/// assert_eq!(ok.len(), 3);
/// let over = parse_batch::<u32>(br#"{"items":[1,2,3,4]}"#, 3);
/// assert_eq!(over, Err(BatchError::TooManyItems { limit: 3 }));
/// ```
pub fn parse_batch<T>(json: &[u8], max: usize) -> Result<Vec<T>, BatchError>
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
        At::OverCap => BatchError::TooManyItems { limit: max },
        At::Item(i) => BatchError::Malformed(InvalidParameter::new(
            format!("items[{i}]"),
            err.to_string(),
        )),
        At::Outside => BatchError::Malformed(InvalidParameter::new("body", err.to_string())),
    })
}

/// The number of items of a batch, without building them; errors as
/// [`parse_batch`].
pub(crate) fn count_batch_items(json: &[u8], max: usize) -> Result<usize, BatchError> {
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
