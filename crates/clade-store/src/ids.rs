//! Typed identifiers. Every id is a BLAKE3 hash; the type says what it names, so a manifest id can never be
//! passed where a tree id is expected.
//!
//! - [`ObjectId`]: BLAKE3 of one block's plain bytes (4 KiB, or shorter at the end of an image): the unit of
//!   deduplication and of verification.
//! - [`FrameId`]: BLAKE3 of the concatenated object ids of a frame, the unit of compression and of reading
//!   (up to 256 blocks); content-derived, so a frame keeps its name when it moves between packs.
//! - [`ManifestId`], [`TreeId`]: BLAKE3 of the encoded manifest or tree.
//! - [`PackId`]: BLAKE3 of a pack's index (which names every frame and object it holds).

use std::fmt;
use std::str::FromStr;

use crate::StoreError;

macro_rules! typed_id {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub [u8; 32]);

        impl $name {
            /// What this id names, for messages.
            pub const KIND: &'static str = $what;
            /// The id of `data` (its BLAKE3 hash).
            pub fn of(data: &[u8]) -> Self {
                Self(*blake3::hash(data).as_bytes())
            }
            /// The 64 hex digits.
            pub fn to_hex(&self) -> String {
                hex::encode(self.0)
            }
            /// The first two hex digits: the fan-out directory.
            pub fn fanout(&self) -> String {
                hex::encode(&self.0[..1])
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.to_hex())
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", stringify!($name), &self.to_hex()[..16])
            }
        }

        impl FromStr for $name {
            type Err = StoreError;
            fn from_str(s: &str) -> Result<Self, StoreError> {
                let mut out = [0u8; 32];
                hex::decode_to_slice(s.trim(), &mut out).map_err(|_| StoreError::BadId {
                    kind: $what,
                    text: s.to_string(),
                })?;
                Ok(Self(out))
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.to_hex())
            }
        }
    };
}

typed_id!(
    /// BLAKE3 of one block's plain bytes.
    ObjectId,
    "object"
);
typed_id!(
    /// BLAKE3 of the object ids of a frame, in order.
    FrameId,
    "frame"
);
typed_id!(
    /// BLAKE3 of an encoded manifest.
    ManifestId,
    "manifest"
);
typed_id!(
    /// BLAKE3 of an encoded directory tree.
    TreeId,
    "tree"
);
typed_id!(
    /// BLAKE3 of a pack's encoded index.
    PackId,
    "pack"
);

impl FrameId {
    /// The id of a frame holding `objects` in this order.
    pub fn of_objects(objects: &[ObjectId]) -> Self {
        let mut h = blake3::Hasher::new();
        for o in objects {
            h.update(&o.0);
        }
        Self(*h.finalize().as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip_and_bad_text() {
        let id = ManifestId::of(b"hello");
        let back: ManifestId = id.to_hex().parse().unwrap();
        assert_eq!(id, back);
        assert_eq!(id.fanout(), id.to_hex()[..2]);
        let err = "zz".parse::<ManifestId>().unwrap_err();
        assert!(err.to_string().contains("manifest"), "{err}");
    }
}
