//! Markdown tables, the one way every report of this crate writes their heads.

/// A table's head: the column names, then the rule, whose columns from index `right_from` on
/// are right-aligned (`---:`) and the ones before it have no alignment (`---`). No newline at
/// the end.
pub fn head<S: AsRef<str>>(columns: &[S], right_from: usize) -> String {
    let mut s = String::from("|");
    for c in columns {
        s.push(' ');
        s.push_str(c.as_ref());
        s.push_str(" |");
    }
    s.push_str("\n|");
    for i in 0..columns.len() {
        s.push_str(if i < right_from { "---|" } else { "---:|" });
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_then_rule() {
        assert_eq!(head(&["a", "b", "c"], 1), "| a | b | c |\n|---|---:|---:|");
        assert_eq!(head(&["a"], usize::MAX), "| a |\n|---|");
    }
}
