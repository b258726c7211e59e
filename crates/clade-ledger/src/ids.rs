//! Typed ids. Every row kind has its own newtype so a mark id can never be passed where a branch id
//! is meant; all are plain strings on disk and on the wire (`serde(transparent)`). Ids of store
//! objects (`ManifestId`) are opaque here: the ledger never parses them, which keeps it store-agnostic.

use rusqlite::types::{FromSql, FromSqlResult, ToSql, ToSqlOutput, ValueRef};
use serde::{Deserialize, Serialize};

macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident, $prefix:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// Wraps an id that already exists (read from a caller, a file or the wire).
            pub fn new(id: impl Into<String>) -> Self {
                Self(id.into())
            }
            /// A fresh random id, `<prefix>-<32 hex digits>`.
            pub fn generate() -> Self {
                Self(format!("{}-{}", $prefix, uuid::Uuid::new_v4().simple()))
            }
            pub fn as_str(&self) -> &str {
                &self.0
            }
            pub fn into_string(self) -> String {
                self.0
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl std::str::FromStr for $name {
            type Err = std::convert::Infallible;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Ok(Self(s.to_owned()))
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                Self(s.to_owned())
            }
        }

        impl From<String> for $name {
            fn from(s: String) -> Self {
                Self(s)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl ToSql for $name {
            fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
                Ok(ToSqlOutput::from(self.0.as_str()))
            }
        }

        impl FromSql for $name {
            fn column_result(value: ValueRef<'_>) -> FromSqlResult<Self> {
                String::column_result(value).map(Self)
            }
        }
    };
}

string_id!(
    /// A template's identity: the hash of everything that shapes it, computed by the caller.
    TemplateId,
    "tp"
);
string_id!(
    /// A sandbox (one QEMU process or one CRIU-restored process tree).
    SandboxId,
    "sb"
);
string_id!(
    /// A branch: a line of marks.
    BranchId,
    "br"
);
string_id!(
    /// A mark: an immutable checkpoint.
    MarkId,
    "mk"
);
string_id!(
    /// A lease: something holding a mark or a manifest alive.
    LeaseId,
    "ls"
);
string_id!(
    /// A store object (a manifest or tree id). Opaque to the ledger.
    ManifestId,
    "mf"
);

/// The row id of an entry in the operations log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct OpId(pub i64);

impl std::fmt::Display for OpId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_ids_carry_their_prefix_and_differ() {
        let a = MarkId::generate();
        let b = MarkId::generate();
        assert!(a.as_str().starts_with("mk-"));
        assert_eq!(a.as_str().len(), 3 + 32);
        assert_ne!(a, b);
        assert!(BranchId::generate().as_str().starts_with("br-"));
    }

    #[test]
    fn ids_serialize_as_plain_strings() {
        let id = SandboxId::new("sb-1");
        assert_eq!(serde_json::to_string(&id).unwrap(), "\"sb-1\"");
        let back: SandboxId = serde_json::from_str("\"sb-1\"").unwrap();
        assert_eq!(back, id);
    }
}
