//! A few top-level string fields of a JSON body, read without building the rest.
//!
//! Stripe, Paddle and Razorpay need two fields (the event id and type) of a body that is often
//! kilobytes of nested objects. Building a whole `serde_json::Value` tree for it, then freeing
//! it, was about 6 % of the gateway's CPU at full load (perf, ingest at c=64); here the other
//! values are only skipped, never allocated. The body must still be valid JSON: skipping
//! checks its syntax, and invalid JSON is refused as [`Rejection::InvalidJson`] as before.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::provider::Rejection;

/// The string values of the top-level fields `names`, in that order (`None`: absent, or not
/// a string). A body whose top level is not an object has none of them. For a name given
/// twice in the body the last value counts, as with `serde_json::Value`.
pub(crate) fn top_level_strings<const N: usize>(
    body: &[u8],
    names: [&str; N],
) -> Result<[Option<String>; N], Rejection> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let found = Fields { names }
        .deserialize(&mut de)
        .and_then(|found| de.end().map(|()| found))
        .map_err(|err| Rejection::InvalidJson {
            detail: err.to_string(),
        })?;
    Ok(found)
}

struct Fields<'n, const N: usize> {
    names: [&'n str; N],
}

impl<'de, const N: usize> DeserializeSeed<'de> for Fields<'_, N> {
    type Value = [Option<String>; N];

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de, const N: usize> Visitor<'de> for Fields<'_, N> {
    type Value = [Option<String>; N];

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found: [Option<String>; N] = std::array::from_fn(|_| None);
        while let Some(key) = map.next_key::<Key<'de>>()? {
            match self.names.iter().position(|name| *name == key.as_str()) {
                Some(at) => found[at] = map.next_value::<MaybeString>()?.0,
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(found)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(std::array::from_fn(|_| None))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(std::array::from_fn(|_| None))
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(std::array::from_fn(|_| None))
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(std::array::from_fn(|_| None))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(std::array::from_fn(|_| None))
    }

    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(std::array::from_fn(|_| None))
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(std::array::from_fn(|_| None))
    }
}

/// An object key: borrowed from the body unless it has escapes.
enum Key<'de> {
    Borrowed(&'de str),
    Owned(String),
}

impl Key<'_> {
    fn as_str(&self) -> &str {
        match self {
            Key::Borrowed(s) => s,
            Key::Owned(s) => s,
        }
    }
}

impl<'de> serde::Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object key")
            }
            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Key<'de>, E> {
                Ok(Key::Borrowed(s))
            }
            fn visit_str<E>(self, s: &str) -> Result<Key<'de>, E> {
                Ok(Key::Owned(s.to_owned()))
            }
        }
        de.deserialize_str(KeyVisitor)
    }
}

/// A value kept when it is a string, skipped otherwise.
struct MaybeString(Option<String>);

impl<'de> serde::Deserialize<'de> for MaybeString {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        struct MaybeStringVisitor;
        impl<'de> Visitor<'de> for MaybeStringVisitor {
            type Value = MaybeString;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_str<E>(self, s: &str) -> Result<MaybeString, E> {
                Ok(MaybeString(Some(s.to_owned())))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<MaybeString, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(MaybeString(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<MaybeString, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(MaybeString(None))
            }
            fn visit_bool<E>(self, _: bool) -> Result<MaybeString, E> {
                Ok(MaybeString(None))
            }
            fn visit_i64<E>(self, _: i64) -> Result<MaybeString, E> {
                Ok(MaybeString(None))
            }
            fn visit_u64<E>(self, _: u64) -> Result<MaybeString, E> {
                Ok(MaybeString(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<MaybeString, E> {
                Ok(MaybeString(None))
            }
            fn visit_unit<E>(self) -> Result<MaybeString, E> {
                Ok(MaybeString(None))
            }
        }
        de.deserialize_any(MaybeStringVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What the adapters did before: the whole tree, then `get(name).as_str()`.
    fn via_value<const N: usize>(
        body: &[u8],
        names: [&str; N],
    ) -> Result<[Option<String>; N], &'static str> {
        let value: serde_json::Value = serde_json::from_slice(body).map_err(|_| "invalid_json")?;
        Ok(names.map(|name| {
            value
                .get(name)
                .and_then(serde_json::Value::as_str)
                .map(str::to_owned)
        }))
    }

    fn fields<const N: usize>(
        body: &[u8],
        names: [&str; N],
    ) -> Result<[Option<String>; N], &'static str> {
        top_level_strings(body, names).map_err(|r| r.code())
    }

    #[test]
    fn reads_top_level_strings_and_skips_everything_else() {
        let body = br#"{"object":"event","data":{"object":{"id":"in_1","type":"x"}},"id":"evt_1","type":"invoice.paid","n":[1,{"id":2}]}"#;
        assert_eq!(
            fields(body, ["id", "type", "absent"]),
            Ok([Some("evt_1".into()), Some("invoice.paid".into()), None])
        );
        // Escapes in keys and values; a non-string value; the last of a repeated name.
        let body = br#"{"i\u0064":"evt_\u00e9","type":7,"id2":null,"type":{"a":1}}"#;
        assert_eq!(
            fields(body, ["id", "type"]),
            Ok([Some("evt_é".into()), None])
        );
        let body = br#"{"id":"first","id":"last"}"#;
        assert_eq!(fields(body, ["id"]), Ok([Some("last".into())]));
        // Not an object at the top: no fields, not an error.
        for body in [&b"[1,2]"[..], b"\"id\"", b"3", b"null", b"true"] {
            assert_eq!(fields(body, ["id"]), Ok([None]));
        }
        // Not JSON, or JSON followed by more: refused.
        for body in [
            &b""[..],
            b"{",
            b"{\"id\":\"a\"} x",
            b"{\"id\":\"a\",}",
            b"{\"a\":[1,]}",
        ] {
            assert_eq!(fields(body, ["id"]), Err("invalid_json"), "{body:?}");
        }
    }

    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            "[a-z\u{e9}\"\\\\ ]{0,8}".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                prop::collection::vec(
                    (
                        prop_oneof![Just("id".to_owned()), Just("type".to_owned()), "[a-z]{1,3}"],
                        inner
                    ),
                    0..5
                )
                .prop_map(|pairs| serde_json::Value::Object(pairs.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Same answer as the whole tree, for any JSON value and for any bytes.
        #[test]
        fn agrees_with_the_whole_tree(value in json_value(), junk in prop::collection::vec(any::<u8>(), 0..16)) {
            let body = serde_json::to_vec(&value).unwrap();
            prop_assert_eq!(fields(&body, ["id", "type"]), via_value(&body, ["id", "type"]));
            prop_assert_eq!(fields(&junk, ["id"]).is_err(), via_value(&junk, ["id"]).is_err());
            let mut cut = body.clone();
            cut.truncate(body.len() / 2);
            prop_assert_eq!(fields(&cut, ["id"]).is_err(), via_value(&cut, ["id"]).is_err());
        }
    }
}
