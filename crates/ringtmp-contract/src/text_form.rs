//! Options whose config-file form is their command-line text (`consistency = "ssp:2"`,
//! `replica-sync = "diloco:50"`): a field `Option<T>` with `#[serde(default, with =
//! "crate::text_form")]` is written with `T`'s `Display` and read with its `FromStr`, the parser
//! clap calls for the flag, so a value is parsed once, the same way from either, and the
//! library receives it typed.
//!
//! Invariant: `T`'s `Display` writes a text its `FromStr` reads back as the same value.

use std::fmt::Display;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serializer};

/// Writes `value` as its text.
pub fn serialize<S: Serializer, T: Display>(
    value: &Option<T>,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    match value {
        Some(v) => s.serialize_some(&v.to_string()),
        None => s.serialize_none(),
    }
}

/// Reads a value from its text.
pub fn deserialize<'de, D: Deserializer<'de>, T>(d: D) -> std::result::Result<Option<T>, D::Error>
where
    T: FromStr,
    T::Err: Display,
{
    Option::<String>::deserialize(d)?
        .map(|text| text.parse().map_err(serde::de::Error::custom))
        .transpose()
}
