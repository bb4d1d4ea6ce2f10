//! A value together with where it came from: the user's choice, or a default the planners may
//! still adapt to the run (a rate scaled with the workers, a schedule a stale strategy was tuned
//! with, a warm-up over the same examples in fewer steps). The origin travels with the value,
//! so no planner reads one without the other, and a planner's adaptation keeps the value a
//! default.
//!
//! Serialised as the bare value, so job files read as before; a value read back is the user's
//! (a job on the wire is planned already: nothing downstream adapts it again).

use std::fmt;
use std::ops::Deref;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Where a setting's value came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The built-in default: a planner may adapt it.
    Default,
    /// The user's choice: kept as it is.
    Given,
}

/// A value and its [`Origin`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Defaulted<T> {
    value: T,
    origin: Origin,
}

impl<T> Defaulted<T> {
    /// The user's `given` value, or `default()`.
    pub fn or_else(given: Option<T>, default: impl FnOnce() -> T) -> Self {
        match given {
            Some(value) => Self::given(value),
            None => Self::default_value(default()),
        }
    }

    /// A value the user chose.
    pub fn given(value: T) -> Self {
        Self {
            value,
            origin: Origin::Given,
        }
    }

    /// A default value.
    pub fn default_value(value: T) -> Self {
        Self {
            value,
            origin: Origin::Default,
        }
    }

    /// Whether the value is the default (a planner may adapt it).
    pub fn is_default(&self) -> bool {
        self.origin == Origin::Default
    }

    /// Where the value came from.
    pub fn origin(&self) -> Origin {
        self.origin
    }

    /// A planner's adaptation of a default: `value` replaces it and stays a default. Returns
    /// whether it did (a given value is kept).
    pub fn adapt(&mut self, adapt: impl FnOnce(&T) -> T) -> bool {
        if self.is_default() {
            self.value = adapt(&self.value);
        }
        self.is_default()
    }

    /// The value.
    pub fn into_inner(self) -> T {
        self.value
    }
}

impl<T> Deref for Defaulted<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T: fmt::Display> fmt::Display for Defaulted<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.value.fmt(f)
    }
}

impl<T: Serialize> Serialize for Defaulted<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.value.serialize(s)
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Defaulted<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        T::deserialize(d).map(Self::given)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_planner_adapts_a_default_and_keeps_a_given_value() {
        let mut rate = Defaulted::or_else(None, || 0.01f32);
        assert!(rate.adapt(|r| r * 4.0));
        assert_eq!((*rate, rate.origin()), (0.04, Origin::Default));
        let mut given = Defaulted::or_else(Some(0.5f32), || 0.01);
        assert!(!given.adapt(|r| r * 4.0));
        assert_eq!((*given, given.origin()), (0.5, Origin::Given));
    }

    #[test]
    fn it_serialises_as_the_bare_value_and_reads_back_as_given() {
        let rate = Defaulted::default_value(0.25f32);
        let text = serde_json::to_string(&rate).expect("serialises");
        assert_eq!(text, "0.25");
        let back: Defaulted<f32> = serde_json::from_str(&text).expect("reads back");
        assert_eq!(back, Defaulted::given(0.25));
    }
}
