//! What the configurations' checks share: the error for a value outside its allowed range, with
//! a message that names the field, what it must be and what it got.

use thiserror::Error;

/// A configuration value outside its allowed range.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("`{field}` must be {expected}, got {value}")]
pub struct OutOfRange {
    pub field: &'static str,
    pub expected: &'static str,
    pub value: String,
}

/// `field` got `value`, which is not `expected`, as any configuration error that can hold it.
pub fn out_of_range<E: From<OutOfRange>>(
    field: &'static str,
    expected: &'static str,
    value: impl ToString,
) -> E {
    E::from(OutOfRange {
        field,
        expected,
        value: value.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_field_the_range_and_the_value() {
        let e: OutOfRange = out_of_range("tick_ms", "between 1 and 1000", 0);
        assert_eq!(e.to_string(), "`tick_ms` must be between 1 and 1000, got 0");
    }
}
