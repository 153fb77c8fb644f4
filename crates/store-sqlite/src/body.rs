//! Request bodies at rest: lz4-compressed when that saves space, stored as they came otherwise.
//!
//! A request row holds its body inline, and a 2 KB body fills most of a 4 KiB page: one row
//! per page, every page written twice (the WAL, then the database file). Compressed, a
//! provider's JSON takes a third to a half of that, so more rows share a page and the writer
//! moves fewer bytes per event. Compression runs on the caller's task before the job reaches
//! the writer thread, which has no time to spare; decompression is cheaper still.
//!
//! `requests.body_codec` says how `body` is stored ([`RAW`] or [`LZ4`], an lz4 block without a
//! header); `requests.body_length` holds the body's length as received (`NULL` in rows written
//! before the codec existed, whose length is `length(body)`).

use bytes::Bytes;
use rusqlite::types::Type;

/// The body as received.
pub(crate) const RAW: i64 = 0;
/// An lz4 block of `body_length` bytes.
pub(crate) const LZ4: i64 = 1;

/// Bodies shorter than this are stored as they came: too little to gain.
const MIN_LEN: usize = 64;

/// A body as it is written to `requests`.
pub(crate) struct Stored {
    pub(crate) codec: i64,
    pub(crate) bytes: Bytes,
    pub(crate) length: i64,
}

/// Compresses `body` when that saves at least an eighth of it.
pub(crate) fn encode(body: &Bytes) -> Stored {
    let length = body.len() as i64;
    if body.len() >= MIN_LEN {
        let compressed = lz4_flex::block::compress(body);
        if compressed.len() <= body.len() - body.len() / 8 {
            return Stored {
                codec: LZ4,
                bytes: Bytes::from(compressed),
                length,
            };
        }
    }
    Stored {
        codec: RAW,
        bytes: body.clone(),
        length,
    }
}

/// The body as received, from a row's `body`, `body_codec` and `body_length`. `column` names
/// the body's column in errors.
pub(crate) fn decode(
    column: usize,
    stored: Vec<u8>,
    codec: i64,
    length: Option<i64>,
) -> rusqlite::Result<Bytes> {
    let broken =
        |why: String| rusqlite::Error::FromSqlConversionFailure(column, Type::Blob, why.into());
    match codec {
        RAW => Ok(Bytes::from(stored)),
        LZ4 => {
            let length = length
                .and_then(|l| usize::try_from(l).ok())
                .ok_or_else(|| broken("a compressed body without its length".to_owned()))?;
            let body = lz4_flex::block::decompress(&stored, length)
                .map_err(|e| broken(format!("a compressed body does not decompress: {e}")))?;
            if body.len() != length {
                return Err(broken(format!(
                    "a compressed body decompressed to {} bytes, not {length}",
                    body.len()
                )));
            }
            Ok(Bytes::from(body))
        }
        other => Err(broken(format!(
            "body codec {other} is unknown to this hooklatch; upgrade hooklatch"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use proptest::prelude::*;

    use super::{decode, encode, LZ4, RAW};

    proptest! {
        /// Whatever the bytes, stored and read back they are the same bytes, and a stored
        /// body is never larger than the body received.
        #[test]
        fn any_body_comes_back_as_it_came(
            body in prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..5000),
                // Runs of a few symbols: what lz4 does compress.
                proptest::collection::vec(prop_oneof![Just(b'a'), Just(b'{'), Just(b'"')], 0..5000),
            ]
        ) {
            let body = Bytes::from(body);
            let stored = encode(&body);
            prop_assert!(stored.bytes.len() <= body.len());
            prop_assert_eq!(stored.length, body.len() as i64);
            let back = decode(0, stored.bytes.to_vec(), stored.codec, Some(stored.length)).unwrap();
            prop_assert_eq!(back, body);
        }

        /// A damaged compressed body (a file edited by hand, a bad disk) is read as an error
        /// or as bytes of the stored length, never as a panic.
        #[test]
        fn a_damaged_compressed_body_never_panics(
            at in any::<prop::sample::Index>(),
            flip in 1u8..=255,
            cut in any::<prop::sample::Index>(),
        ) {
            let body = Bytes::from("{\"object\":\"line_item\",\"currency\":\"usd\"}".repeat(40));
            let stored = encode(&body);
            prop_assert_eq!(stored.codec, LZ4);
            let mut damaged = stored.bytes.to_vec();
            let i = at.index(damaged.len());
            damaged[i] ^= flip;
            damaged.truncate(cut.index(damaged.len()) + 1);
            if let Ok(back) = decode(0, damaged, LZ4, Some(stored.length)) {
                prop_assert_eq!(back.len(), body.len());
            }
        }
    }

    #[test]
    fn json_is_compressed_and_comes_back_byte_exact() {
        let body = Bytes::from(
            (0..40)
                .map(|i| {
                    format!(
                        "{{\"id\":\"il_{i:08}\",\"object\":\"line_item\",\"currency\":\"usd\"}}"
                    )
                })
                .collect::<Vec<_>>()
                .join(",\n  "),
        );
        let stored = encode(&body);
        assert_eq!(stored.codec, LZ4);
        assert!(
            stored.bytes.len() < body.len() / 2,
            "{}",
            stored.bytes.len()
        );
        assert_eq!(stored.length, body.len() as i64);
        let back = decode(0, stored.bytes.to_vec(), stored.codec, Some(stored.length)).unwrap();
        assert_eq!(back, body);
    }

    #[test]
    fn short_and_incompressible_bodies_are_stored_as_they_came() {
        // A fixed sequence of well-mixed bytes: lz4 finds nothing to repeat in it.
        let mut x: u64 = 0x2545_F491_4F6C_DD1D;
        let noise: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        for body in [
            Bytes::new(),
            Bytes::from_static(b"{\"id\":\"evt_1\"}"),
            Bytes::from(noise),
        ] {
            let stored = encode(&body);
            assert_eq!(stored.codec, RAW);
            assert_eq!(stored.bytes, body);
            let back = decode(0, stored.bytes.to_vec(), RAW, Some(stored.length)).unwrap();
            assert_eq!(back, body);
        }
    }

    #[test]
    fn a_broken_or_unknown_body_is_an_error_not_a_panic() {
        let body = Bytes::from(vec![b'a'; 1000]);
        let stored = encode(&body);
        assert_eq!(stored.codec, LZ4);
        let cut = stored.bytes[..stored.bytes.len() / 2].to_vec();
        assert!(decode(3, cut, LZ4, Some(1000)).is_err());
        assert!(decode(3, stored.bytes.to_vec(), LZ4, Some(999)).is_err());
        assert!(decode(3, stored.bytes.to_vec(), LZ4, Some(5000)).is_err());
        assert!(decode(3, stored.bytes.to_vec(), LZ4, None).is_err());
        let err = decode(3, b"x".to_vec(), 9, None).unwrap_err().to_string();
        assert!(err.contains("codec 9"), "{err}");
    }
}
