//! Validated names and identifiers. Holding one means it is valid.
//!
//! Row ids carry a readable prefix when shown (`req_42`, `dlv_7`) and parse back from either
//! form, so an operator can paste what the API printed.

use std::fmt;

/// Why a name or key was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// Empty string.
    #[error("is empty")]
    Empty,
    /// Longer than allowed.
    #[error("is longer than {max} bytes")]
    TooLong {
        /// The limit.
        max: usize,
    },
    /// A character outside the allowed set.
    #[error("contains {0:?}; use letters, digits, '-' and '_'")]
    BadChar(char),
}

/// A configured source's name: the `{source}` in `POST /in/{source}`.
/// Letters, digits, `-` and `_`; at most 64 bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceName(String);

impl SourceName {
    /// Checks and wraps a source name.
    pub fn parse(s: &str) -> Result<SourceName, NameError> {
        if s.is_empty() {
            return Err(NameError::Empty);
        }
        if s.len() > 64 {
            return Err(NameError::TooLong { max: 64 });
        }
        if let Some(c) = s
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
        {
            return Err(NameError::BadChar(c));
        }
        Ok(SourceName(s.to_owned()))
    }

    /// The name as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SourceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The provider's stable identifier of one event (Stripe's `evt_…`, GitHub's delivery GUID).
/// Any printable text without control characters, at most 256 bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventKey(String);

impl EventKey {
    /// The longest key accepted, in bytes.
    pub const MAX_LEN: usize = 256;

    /// Checks and wraps an event key.
    pub fn parse(s: &str) -> Result<EventKey, NameError> {
        if s.trim().is_empty() {
            return Err(NameError::Empty);
        }
        if s.len() > Self::MAX_LEN {
            return Err(NameError::TooLong { max: Self::MAX_LEN });
        }
        if let Some(c) = s.chars().find(|c| c.is_control()) {
            return Err(NameError::BadChar(c));
        }
        Ok(EventKey(s.to_owned()))
    }

    /// The key as the provider sent it.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for EventKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What every delivery of one event carries as `Idempotency-Key`: `{source}:{event key}`.
/// The same on every attempt and every replay, so the application's guard decides.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// The key for an event of a source.
    pub fn new(source: &SourceName, key: &EventKey) -> IdempotencyKey {
        IdempotencyKey(format!("{}:{}", source.as_str(), key.as_str()))
    }

    /// Wraps a key read back from the store.
    pub fn from_stored(s: String) -> IdempotencyKey {
        IdempotencyKey(s)
    }

    /// The key as sent in the header.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

macro_rules! prefixed_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub i64);

        impl $name {
            /// The prefix shown before the number.
            pub const PREFIX: &'static str = $prefix;

            /// Parses `12` or the prefixed form.
            pub fn parse(s: &str) -> Option<$name> {
                let digits = s.strip_prefix($prefix).unwrap_or(s);
                digits.parse::<i64>().ok().filter(|n| *n > 0).map($name)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}{}", $prefix, self.0)
            }
        }
    };
}

prefixed_id!(
    /// One inbound request in history, accepted or not.
    RequestId,
    "req_"
);
prefixed_id!(
    /// One event's delivery to one destination (an outbox row).
    DeliveryId,
    "dlv_"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check_source(input: &str, ok: bool) {
        assert_eq!(SourceName::parse(input).is_ok(), ok, "{input:?}");
    }

    #[test]
    fn source_names() {
        check_source("stripe", true);
        check_source("stripe-live_2", true);
        check_source("", false);
        check_source("a/b", false);
        check_source("café", false);
        check_source(&"x".repeat(65), false);
    }

    #[test]
    fn event_keys_refuse_control_characters_and_blanks() {
        assert!(EventKey::parse("evt_1").is_ok());
        assert!(EventKey::parse("  ").is_err());
        assert!(EventKey::parse("a\nb").is_err());
        assert!(EventKey::parse(&"k".repeat(257)).is_err());
    }

    #[test]
    fn prefixed_ids_round_trip() {
        assert_eq!(RequestId::parse("req_12"), Some(RequestId(12)));
        assert_eq!(RequestId::parse("12"), Some(RequestId(12)));
        assert_eq!(RequestId::parse("dlv_12"), None);
        assert_eq!(DeliveryId(7).to_string(), "dlv_7");
    }
}
