//! The documentation's links: every link in `README.md` and in the Markdown files under `docs/`
//! resolves, and the README stays a front page.
//!
//! - Inline links and images, `[text](target)` and `![alt](target)`, are read outside fenced code
//!   blocks and inline code spans; `http://`, `https://` and `mailto:` targets are not checked.
//! - A relative target must exist, a file or a directory, resolved from the linking file's
//!   directory.
//! - A `#fragment` into a Markdown file (or a bare `#fragment`, into the linking file itself) must
//!   be the GitHub anchor of one of its headings: lowercased, every character but alphanumerics,
//!   spaces, `-` and `_` dropped, spaces turned into `-`, and `-1`, `-2`... after a repeated one.
//! - `README.md` has at most 300 lines.
//!
//! Needs nothing but the checkout. The failure lists every broken link with its file and line.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use kvoy_testkit::workspace_root;

const README_MAX_LINES: usize = 300;

/// A link found in a Markdown file: its 1-based line and its target as written.
#[derive(Debug, PartialEq)]
struct Link {
    line: usize,
    target: String,
}

/// The lines outside fenced code blocks, each with its 1-based number.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut fence: Option<(char, usize)> = None;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let marker = trimmed.chars().next().filter(|c| *c == '`' || *c == '~');
        let run = marker.map_or(0, |c| trimmed.chars().take_while(|x| *x == c).count());
        match (fence, marker) {
            (None, Some(c)) if run >= 3 => fence = Some((c, run)),
            (Some((c, n)), Some(m)) if m == c && run >= n && trimmed[run..].trim().is_empty() => {
                fence = None
            }
            (None, _) => out.push((i + 1, line)),
            _ => {}
        }
    }
    out
}

/// The inline links and images of `text`. Code spans may run over line breaks inside a
/// paragraph, so each paragraph (a run of non-blank prose lines) is read as one.
fn links(text: &str) -> Vec<Link> {
    let mut found = Vec::new();
    let lines = prose_lines(text);
    let mut start = 0;
    while start < lines.len() {
        let mut end = start;
        while end < lines.len()
            && !lines[end].1.trim().is_empty()
            && (end == start || lines[end].0 == lines[end - 1].0 + 1)
        {
            end += 1;
        }
        if end == start {
            start += 1;
            continue;
        }
        let first_line = lines[start].0;
        let paragraph: Vec<char> = lines[start..end]
            .iter()
            .map(|(_, l)| *l)
            .collect::<Vec<_>>()
            .join("\n")
            .chars()
            .collect();
        let masked = mask_code_spans(&paragraph);
        for i in 0..masked.len().saturating_sub(1) {
            if masked[i] != ']' || masked[i + 1] != '(' {
                continue;
            }
            let Some(close) = masked[i + 2..].iter().position(|c| *c == ')') else {
                continue;
            };
            let inner: String = masked[i + 2..i + 2 + close].iter().collect();
            // `(target "title")`, `(<target>)`.
            let target = inner.split_whitespace().next().unwrap_or("");
            let target = target.trim_start_matches('<').trim_end_matches('>');
            let line = first_line + masked[..i].iter().filter(|c| **c == '\n').count();
            found.push(Link {
                line,
                target: target.to_string(),
            });
        }
        start = end;
    }
    found
}

/// `paragraph` with every inline code span (a run of n backticks up to the next run of exactly
/// n) blanked out; line breaks are kept, so positions still give the line.
fn mask_code_spans(paragraph: &[char]) -> Vec<char> {
    let run_at = |i: usize| paragraph[i..].iter().take_while(|c| **c == '`').count();
    let mut out = paragraph.to_vec();
    let mut i = 0;
    while i < paragraph.len() {
        if paragraph[i] != '`' {
            i += 1;
            continue;
        }
        let n = run_at(i);
        let mut j = i + n;
        let mut close = None;
        while j < paragraph.len() {
            if paragraph[j] == '`' {
                let m = run_at(j);
                if m == n {
                    close = Some(j + m);
                    break;
                }
                j += m;
            } else {
                j += 1;
            }
        }
        match close {
            Some(end) => {
                for c in &mut out[i..end] {
                    if *c != '\n' {
                        *c = ' ';
                    }
                }
                i = end;
            }
            // No closing run: the backticks are literal.
            None => i += n,
        }
    }
    out
}

/// GitHub's anchor for a heading's text.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown file's ATX headings, repeated ones numbered as GitHub does.
fn anchors(text: &str) -> HashSet<String> {
    let mut seen = HashSet::new();
    let mut counts: HashMap<String, usize> = HashMap::new();
    for (_, line) in prose_lines(text) {
        let hashes = line.chars().take_while(|c| *c == '#').count();
        let rest = &line[hashes..];
        if !(1..=6).contains(&hashes) || !(rest.is_empty() || rest.starts_with(' ')) {
            continue;
        }
        let base = slug(rest.trim().trim_end_matches('#'));
        let n = counts.entry(base.clone()).or_insert(0);
        let mut anchor = base.clone();
        while !seen.insert(anchor.clone()) {
            *n += 1;
            anchor = format!("{base}-{n}");
        }
    }
    seen
}

/// Every `.md` file under `dir`, recursively.
fn markdown_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            markdown_under(&path, out);
        } else if path.extension().is_some_and(|e| e == "md") {
            out.push(path);
        }
    }
}

/// What is wrong with `link` in `file`, if anything.
fn broken(
    file: &Path,
    link: &Link,
    cache: &mut HashMap<PathBuf, HashSet<String>>,
) -> Option<String> {
    let target = link.target.as_str();
    if target.is_empty() {
        return Some("empty target".into());
    }
    if ["http://", "https://", "mailto:"]
        .iter()
        .any(|p| target.starts_with(p))
    {
        return None;
    }
    let (path, fragment) = match target.split_once('#') {
        Some((p, f)) => (p, Some(f)),
        None => (target, None),
    };
    let resolved = if path.is_empty() {
        file.to_path_buf()
    } else {
        file.parent().unwrap().join(path)
    };
    if !resolved.exists() {
        return Some(format!("{} does not exist", resolved.display()));
    }
    let fragment = fragment?;
    if resolved.extension().is_none_or(|e| e != "md") {
        return None;
    }
    let known = cache
        .entry(resolved.clone())
        .or_insert_with(|| anchors(&std::fs::read_to_string(&resolved).unwrap()));
    (!known.contains(fragment)).then(|| {
        format!(
            "{} has no heading with the anchor #{fragment}",
            resolved.display()
        )
    })
}

#[test]
fn every_link_in_the_readme_and_docs_resolves() {
    let root = workspace_root();
    let mut files = vec![root.join("README.md")];
    markdown_under(&root.join("docs"), &mut files);
    files.sort();

    let mut cache = HashMap::new();
    let mut failures = Vec::new();
    let mut checked = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let shown = file.strip_prefix(&root).unwrap().display().to_string();
        for link in links(&text) {
            checked += 1;
            if let Some(why) = broken(file, &link, &mut cache) {
                failures.push(format!("{shown}:{}: ({}): {why}", link.line, link.target));
            }
        }
    }
    let readme_lines = std::fs::read_to_string(root.join("README.md"))
        .unwrap()
        .lines()
        .count();
    if readme_lines > README_MAX_LINES {
        failures.push(format!(
            "README.md has {readme_lines} lines, more than {README_MAX_LINES}: move detail into docs/"
        ));
    }
    eprintln!("checked {checked} links in {} files", files.len());
    assert!(
        checked > 50,
        "only {checked} links found: is the scanner broken?"
    );
    assert!(
        failures.is_empty(),
        "{} broken:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn the_scanner_skips_code_and_numbers_repeated_headings() {
    let text = "\
# Top: `kvoy-local`
See [a](a.md#x) and `[not](code.md)`, ``[nor](this.md)``, and a span `over
a line [no](no.md)` then ![img](i.png \"title\").

```sh
[fenced](no.md)
```
## Top: kvoy-local
## Top: kvoy-local
";
    let got: Vec<(usize, String)> = links(text)
        .into_iter()
        .map(|l| (l.line, l.target))
        .collect();
    assert_eq!(got, [(2, "a.md#x".to_string()), (3, "i.png".to_string())]);
    let a = anchors(text);
    for anchor in ["top-kvoy-local", "top-kvoy-local-1", "top-kvoy-local-2"] {
        assert!(a.contains(anchor), "{anchor} in {a:?}");
    }
    assert_eq!(
        slug("Overhead against the external picker (ext_proc)"),
        "overhead-against-the-external-picker-ext_proc"
    );
}
