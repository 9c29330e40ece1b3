//! docs/troubleshooting.md quotes the error messages gpu-ckpt writes; this test holds every quote
//! to the code's string literals, so that a message changed in the code (or mistyped in the doc)
//! fails here instead of drifting. Plain file reading: no stack, no root. The doc is read with
//! pulldown-cmark (CommonMark's fences, code spans and bold spans), the code with syn.
//!
//! What counts as a quoted message in the doc (the rule):
//! - every fenced code block, except blocks tagged as shell (`sh`, `bash`, `shell`, `console`),
//!   which hold commands; the lines of one block are one message (see below);
//! - every code span inside a bold span that *opens* with a code span (`**`…` …**`, the doc's
//!   "this is the error text" headings), e.g. both spans of `**`gpu-ckpt build` says `…`**`;
//! - except a code span that starts with a program's name and a space (`gpu-ckpt `, `kubectl `,
//!   `ctr `, `crictl `, `curl `): a command, skipped (the test prints which).
//!
//! Nothing else is read: not code spans in prose, lists or tables, nor in bold spans that open
//! with prose (`**A pod fails with `…`**`). That is where the doc quotes texts other programs
//! write (containerd, the kubelet, CRIU: `404 page not found`), so there is no allow-list: a
//! third-party text must not be put in a fence or a bold span opening with a code span.
//!
//! What the code's messages are: the string literals of every `*.rs` under shim/src,
//! image-format/src, registry/src, cli/src, gpu/, oci-hooks/src and runtime-class/ (target/ and
//! tests/ directories excluded; a file syn cannot parse fails the test), in expressions,
//! attributes (`#[error("…")]`) and macro calls (`format!`, `bail!`; their tokens), not doc
//! comments; escapes decoded and `\`-newline continuations joined, each cut at its format
//! placeholders (`{}`, `{name}`, `{:?}`, `{0}`, `{name:>8}` …; `{{`/`}}` are literal braces) and
//! at its newlines into fixed fragments. Only literals that are messages give fragments: those
//! with a placeholder or with whitespace. A literal with neither (`criu`, `/usr/local/bin`, `.`)
//! is a value the code puts into a message; quoted in the doc, it reads as a value (c).
//!
//! A message line matches when it can be cut, left to right, into pieces each of which is
//! (a) a whole fixed fragment; or, as the line's first piece, a suffix of one, and, as its last
//!     piece, a prefix of one (a single piece: any part of one), provided that partial piece is
//!     at least [`MIN_PARTIAL`] characters long or sits right next to a `…` that opens (closes)
//!     the line;
//! (b) a doc placeholder: `{…}` (any text in braces, never read as anything else) or `…`;
//! (c) a concrete value, what a placeholder printed: non-whitespace characters (`3.17.1`,
//!     `/usr/local/bin/criu`, `127.0.0.1:5443`, the quotes that `{:?}` prints).
//!
//! Whitespace is matched only by fragments. A cut also keeps to the code's shape (details at
//! [`cut_line`]): no cut next to a fixed piece falls inside a word (`3.17.1` is never the
//! fragments `1` and `7`); a value or doc placeholder sits next to a fragment only on a side where
//! the code has a placeholder; and glue alone (` `, `) (`, from `{} {}` and the like) never joins
//! two values. Each line of a block is cut on its own, and at least half of the message's
//! characters, over all its lines, must be fixed text (a), each doc placeholder counting as one
//! character (it stands for one value, however long its name): a message made of values alone,
//! or of a few matching words among values, fails. The cut with the most fixed text is taken
//! (dynamic programming over the characters).
//!
//! Known limit: fragments are matched one by one, not in their literal's order, so a changed
//! word right next to a placeholder or a short common fragment (`CRIU `, `file `) can still read
//! as a value; a changed word inside a longer run of the code's text fails.
//!
//! A message that fails is reported with the longest prefix of its line that could be cut, or
//! with its count of fixed characters; run with `--nocapture` to see how every message was cut
//! (`«fixed»`, `[placeholder or value]`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use proc_macro2::{Delimiter, TokenTree};
use pulldown_cmark::{CodeBlockKind, Event, Parser, Tag, TagEnd};
use syn::visit::Visit;

const DOC: &str = "docs/troubleshooting.md";
/// Where the messages gpu-ckpt writes come from, relative to the repository's root.
const SOURCES: &[&str] = &[
    "shim/src",
    "image-format/src",
    "registry/src",
    "cli/src",
    "gpu",
    "oci-hooks/src",
    "runtime-class",
];
/// The shortest part of a fragment that may open or close a message without a `…` there.
const MIN_PARTIAL: usize = 12;
/// A code span starting with one of these quotes a command, not a message.
const COMMANDS: &[&str] = &["gpu-ckpt ", "kubectl ", "ctr ", "crictl ", "curl "];
/// Fenced blocks with these info strings hold commands.
const SHELL_FENCES: &[&str] = &["sh", "bash", "shell", "console"];
const ELLIPSIS: char = '…';

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

// ---------------------------------------------------------------------------------------------
// The doc's quoted messages.

/// A message the doc quotes: its 1-based line in the doc and its text (lines joined by `\n`).
#[derive(Debug, Clone, PartialEq)]
struct Quote {
    line: usize,
    text: String,
}

/// The quoted messages of `md`, and the code spans skipped as commands.
fn quotes(md: &str) -> (Vec<Quote>, Vec<String>) {
    let line_of = |offset: usize| md[..offset].matches('\n').count() + 1;
    let mut found = Vec::new();
    let mut commands = Vec::new();
    // The fenced block being read: its first line and its text so far.
    let mut block: Option<(usize, String)> = None;
    // Open bold spans, and whether the outermost one opened with a code span.
    let mut bold = 0;
    let mut quoting = false;
    let mut events = Parser::new(md).into_offset_iter().peekable();
    while let Some((event, range)) = events.next() {
        match event {
            Event::Start(Tag::CodeBlock(CodeBlockKind::Fenced(info))) => {
                let shell = SHELL_FENCES.contains(&info.trim());
                block = (!shell).then(|| (line_of(range.start) + 1, String::new()));
            }
            Event::Text(t) if block.is_some() => {
                if let Some((_, text)) = block.as_mut() {
                    text.push_str(&t);
                }
            }
            Event::End(TagEnd::CodeBlock) => {
                if let Some((line, text)) = block.take() {
                    let text = text.strip_suffix('\n').unwrap_or(&text).to_string();
                    found.push(Quote { line, text });
                }
            }
            Event::Start(Tag::Strong) => {
                if bold == 0 {
                    quoting = matches!(events.peek(), Some((Event::Code(_), _)));
                }
                bold += 1;
            }
            Event::End(TagEnd::Strong) => bold -= 1,
            Event::Code(span) if bold > 0 && quoting => {
                if COMMANDS.iter().any(|c| span.starts_with(c)) {
                    commands.push(span.to_string());
                } else {
                    found.push(Quote {
                        line: line_of(range.start),
                        text: span.to_string(),
                    });
                }
            }
            _ => {}
        }
    }
    (found, commands)
}

// ---------------------------------------------------------------------------------------------
// The code's string literals and their fixed fragments.

/// The string literals of the Rust source `src`, decoded (escapes resolved, `\`-newline
/// continuations joined), in the order they appear: in the syntax tree, and in the tokens of
/// macro calls and attribute arguments, which syn leaves unparsed. Doc comments are not literals
/// (they are `#[doc = "…"]` attributes to syn, in macro tokens too). Byte and C strings count.
fn string_literals(src: &str) -> syn::Result<Vec<String>> {
    let file = syn::parse_file(src)?;
    let mut lits = Literals(Vec::new());
    lits.visit_file(&file);
    Ok(lits.0)
}

struct Literals(Vec<String>);

impl Literals {
    /// The literals among `tokens`, nested groups included, doc attributes (`#[doc = …]`,
    /// `#![doc = …]`) left out.
    fn tokens(&mut self, tokens: proc_macro2::TokenStream) {
        let mut after_hash = false;
        for tt in tokens {
            match tt {
                TokenTree::Literal(l) => self.visit_lit(&syn::Lit::new(l)),
                TokenTree::Group(g) => {
                    let doc = after_hash
                        && g.delimiter() == Delimiter::Bracket
                        && matches!(g.stream().into_iter().next(),
                                    Some(TokenTree::Ident(i)) if i == "doc");
                    if !doc {
                        self.tokens(g.stream());
                    }
                }
                TokenTree::Punct(ref p) if p.as_char() == '#' => {
                    after_hash = true;
                    continue;
                }
                TokenTree::Punct(ref p) if p.as_char() == '!' && after_hash => continue,
                _ => {}
            }
            after_hash = false;
        }
    }
}

impl<'ast> Visit<'ast> for Literals {
    fn visit_lit_str(&mut self, lit: &'ast syn::LitStr) {
        self.0.push(lit.value());
    }

    fn visit_lit_byte_str(&mut self, lit: &'ast syn::LitByteStr) {
        self.0
            .push(String::from_utf8_lossy(&lit.value()).into_owned());
    }

    fn visit_lit_cstr(&mut self, lit: &'ast syn::LitCStr) {
        self.0.push(lit.value().to_string_lossy().into_owned());
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.tokens(mac.tokens.clone());
    }

    fn visit_attribute(&mut self, attr: &'ast syn::Attribute) {
        match &attr.meta {
            _ if attr.path().is_ident("doc") => {}
            syn::Meta::List(list) => self.tokens(list.tokens.clone()),
            meta => syn::visit::visit_meta(self, meta),
        }
    }
}

/// The fixed fragments of `lit` read as a format string: the text between its placeholders
/// (`{{` and `}}` standing for braces), cut again at newlines; empty fragments dropped. A `{`
/// that does not open a placeholder (`{` + name or index + optional `:spec` + `}`) is text.
fn fragments(lit: &str) -> Vec<String> {
    split_format(lit).into_iter().map(|f| f.text).collect()
}

/// A fixed fragment, and whether a placeholder touches it at its start and at its end (rather
/// than the literal's start or end, or a newline).
#[derive(Debug, Clone, PartialEq)]
struct Fragment {
    text: String,
    open_start: bool,
    open_end: bool,
}

/// [`fragments`], with their sides.
fn split_format(lit: &str) -> Vec<Fragment> {
    // The text between placeholders: (text, a placeholder before it, a placeholder after it).
    let mut parts: Vec<(String, bool, bool)> = Vec::new();
    let mut cur = String::new();
    let mut open = false;
    let mut rest = lit;
    while let Some(ch) = rest.chars().next() {
        if let Some(r) = rest.strip_prefix("{{") {
            cur.push('{');
            rest = r;
        } else if let Some(r) = rest.strip_prefix("}}") {
            cur.push('}');
            rest = r;
        } else if ch == '{' {
            match rest[1..].find('}') {
                Some(end) if is_placeholder(&rest[1..1 + end]) => {
                    parts.push((std::mem::take(&mut cur), open, true));
                    open = true;
                    rest = &rest[1 + end + 1..];
                }
                _ => {
                    cur.push('{');
                    rest = &rest[1..];
                }
            }
        } else {
            cur.push(ch);
            rest = &rest[ch.len_utf8()..];
        }
    }
    parts.push((cur, open, false));
    let mut out = Vec::new();
    for (text, before, after) in parts {
        let lines: Vec<&str> = text.split('\n').collect();
        let last = lines.len() - 1;
        for (k, line) in lines.into_iter().enumerate() {
            if !line.is_empty() {
                out.push(Fragment {
                    text: line.to_string(),
                    open_start: k == 0 && before,
                    open_end: k == last && after,
                });
            }
        }
    }
    out
}

/// Whether `lit`, read as a format string, has a placeholder.
fn has_placeholder(lit: &str) -> bool {
    let unescaped = lit.replace("{{", "").replace("}}", "");
    let mut rest = unescaped.as_str();
    while let Some(open) = rest.find('{') {
        rest = &rest[open + 1..];
        if let Some(close) = rest.find('}') {
            if is_placeholder(&rest[..close]) {
                return true;
            }
        }
    }
    false
}

/// Whether `inner` (between `{` and `}`) is a format placeholder's: an argument (empty, a name
/// or an index), then optionally `:` and a spec without braces.
fn is_placeholder(inner: &str) -> bool {
    let (arg, spec) = inner.split_once(':').unwrap_or((inner, ""));
    arg.chars().all(|c| c.is_alphanumeric() || c == '_') && !spec.contains(['{', '}'])
}

/// The fixed fragments of every source literal, indexed by their first character.
struct Fragments {
    all: Vec<Vec<char>>,
    /// For each of `all`: whether a placeholder touches it at its start, at its end (in any of
    /// the literals it is a fragment of).
    open: Vec<(bool, bool)>,
    by_first: HashMap<char, Vec<usize>>,
}

impl Fragments {
    /// The fragments of those `literals` that are messages: format strings (with a placeholder)
    /// and texts with whitespace inside. A literal without either (`criu`, `/usr/local/bin`, `.`,
    /// `done\n`) is a value that the code puts into a message (or writes to a pipe), and where a
    /// doc quotes it, it reads as a value.
    fn new(literals: impl IntoIterator<Item = String>) -> Fragments {
        let mut sides: BTreeMap<String, (bool, bool)> = BTreeMap::new();
        for l in literals {
            if !(l.trim().contains(char::is_whitespace) || has_placeholder(&l)) {
                continue;
            }
            for f in split_format(&l) {
                let e = sides.entry(f.text).or_default();
                e.0 |= f.open_start;
                e.1 |= f.open_end;
            }
        }
        let all: Vec<Vec<char>> = sides.keys().map(|f| f.chars().collect()).collect();
        let open = sides.values().copied().collect();
        let mut by_first: HashMap<char, Vec<usize>> = HashMap::new();
        for (k, f) in all.iter().enumerate() {
            by_first.entry(f[0]).or_default().push(k);
        }
        Fragments {
            all,
            open,
            by_first,
        }
    }

    /// The fragments starting with `ch`, with their sides.
    fn starting_with(&self, ch: char) -> impl Iterator<Item = (&[char], (bool, bool))> {
        self.by_first
            .get(&ch)
            .into_iter()
            .flatten()
            .map(|&k| (self.all[k].as_slice(), self.open[k]))
    }
}

/// The literals of every `*.rs` under [`SOURCES`] (target/ and tests/ directories skipped).
fn source_literals(root: &Path) -> (Vec<String>, usize) {
    fn walk(dir: &Path, files: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            let name = e.file_name();
            if p.is_dir() {
                if name != "target" && name != "tests" {
                    walk(&p, files);
                }
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    let mut files = Vec::new();
    for s in SOURCES {
        let dir = root.join(s);
        assert!(dir.is_dir(), "{}: not a directory", dir.display());
        walk(&dir, &mut files);
    }
    let mut lits = Vec::new();
    for f in &files {
        let src = std::fs::read_to_string(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let found = string_literals(&src)
            .unwrap_or_else(|e| panic!("{}: syn cannot parse it: {e}", f.display()));
        lits.extend(found);
    }
    (lits, files.len())
}

// ---------------------------------------------------------------------------------------------
// Segmentation.

/// How one line of a message was cut.
#[derive(Debug)]
struct LineCut {
    /// The most fixed-fragment characters of a complete cut; `None`: there is none.
    fixed: Option<usize>,
    /// The line's length for the coverage rule: characters, a doc placeholder counting as one.
    weight: usize,
    /// The longest prefix (in characters) that some cut reaches.
    reached: usize,
    /// The best complete cut, shown as `«fixed»` and `[placeholder or value]` pieces.
    shown: String,
}

/// The end (exclusive) of the doc placeholder `{…}` starting at `line[i]`, if one does.
fn doc_placeholder_end(line: &[char], i: usize) -> Option<usize> {
    if line[i] == ELLIPSIS {
        return Some(i + 1);
    }
    if line[i] != '{' {
        return None;
    }
    let close = line[i + 1..].iter().position(|&c| c == '}' || c == '{')?;
    (line[i + 1 + close] == '}').then_some(i + 1 + close + 1)
}

fn weight(line: &[char]) -> usize {
    let mut w = 0;
    let mut i = 0;
    while i < line.len() {
        i = doc_placeholder_end(line, i).unwrap_or(i + 1);
        w += 1;
    }
    w
}

/// Whether a character is part of a word: pieces never cut a word (see [`cut_line`]).
fn wordy(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The states of a cut: the kind of its last piece. A fixed piece whose end a placeholder
/// touches in the code (a value or a doc placeholder may follow it) ...
const FIXED_OPEN: usize = 0;
/// ... one that ends where its literal (or line) ends (only fixed text may follow it) ...
const FIXED_CLOSED: usize = 1;
/// ... glue (whitespace and punctuation only, like ` ` or `) `) right after a value, or after
/// such glue: no value may follow ...
const GLUE_AFTER_VALUE: usize = 2;
/// ... a doc placeholder; a value; nothing yet.
const PLACEHOLDER: usize = 3;
const VALUE: usize = 4;
const START: usize = 5;
const STATES: usize = 6;

/// The kinds of piece.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// A fixed fragment or part of one, and whether a placeholder touches it at its start and
    /// its end in the code.
    Fixed(bool, bool),
    Placeholder,
    Value,
}

/// Whether `piece` of a fixed fragment is glue: no letter or digit, some whitespace.
fn glue(piece: &[char]) -> bool {
    !piece.iter().any(|&c| wordy(c)) && piece.iter().any(|c| c.is_whitespace())
}

/// Cuts `line` into fragments, placeholders and values (see the module's doc), maximizing the
/// characters covered by fragments. More rules keep the count honest:
/// - a doc placeholder is only ever a placeholder (no fragment or value covers its text);
/// - no cut next to a fixed piece falls inside a word (`3.17.1` is one value, never the
///   fragments `1` and `7`; `mismatched` is not the fragment `mismatch` and the value `ed`);
/// - a value or doc placeholder sits next to a fragment only where the code has a placeholder
///   next to that fragment: `{source} has no gpu-ckpt manifest` is the code's, `X has no
///   gpu-ckpt manifest: it is not a complete gpu-ckpt checkpoint Y` is not;
/// - two values are never joined by glue alone (` `, `, `, `) (`): a word changed in the doc
///   would otherwise read as a run of values (`a key it [knows] (set`), since `{} {}` and the
///   like are in the code. Values in the doc stand apart, by the code's words or placeholders.
fn cut_line(line: &[char], frags: &Fragments) -> LineCut {
    let n = line.len();
    // Characters inside doc placeholders; prefix sums to test ranges.
    let mut locked = vec![0usize; n + 1];
    let mut i = 0;
    while i < n {
        let end = doc_placeholder_end(line, i).unwrap_or(i);
        for k in i..end {
            locked[k + 1] = 1;
        }
        i = end.max(i + 1);
    }
    for k in 0..n {
        locked[k + 1] += locked[k];
    }
    let free = |a: usize, b: usize| locked[b] == locked[a];
    // Where a partial piece may start or end, and how long it must then be.
    let mut starts = vec![(0, MIN_PARTIAL)];
    if line.first() == Some(&ELLIPSIS) {
        starts.push((1, 1));
    }
    let mut ends = vec![(n, MIN_PARTIAL)];
    if n > 0 && line[n - 1] == ELLIPSIS {
        ends.push((n - 1, 1));
    }
    let word_cut = |k: usize| k > 0 && k < n && wordy(line[k - 1]) && wordy(line[k]);
    // best[k][state]: the most fixed characters of a cut of line[..k] in that state, and where
    // its last piece started (and the state there).
    type Best = Option<(usize, usize, usize)>;
    let mut best: Vec<[Best; STATES]> = vec![[None; STATES]; n + 1];
    best[0][START] = Some((0, 0, START));
    for i in 0..n {
        // The pieces that may start at i: (end, kind).
        let mut pieces: Vec<(usize, Kind)> = Vec::new();
        // (a) whole fragments.
        for (f, (os, oe)) in frags.starting_with(line[i]) {
            if line[i..].starts_with(f) {
                pieces.push((i + f.len(), Kind::Fixed(os, oe)));
            }
        }
        // (a) the line's first piece: a suffix of a fragment, or (also its last) any part.
        for &(s, smin) in starts.iter().filter(|&&(s, _)| s == i) {
            for (f, &(_, oe)) in frags.all.iter().zip(&frags.open) {
                for p in 1..f.len() {
                    let suffix = &f[p..];
                    if suffix.len() >= smin && line[s..].starts_with(suffix) {
                        pieces.push((s + suffix.len(), Kind::Fixed(true, oe)));
                    }
                }
            }
            for &(e, emin) in &ends {
                if e > s && e - s >= smin.max(emin) {
                    let part = &line[s..e];
                    if frags
                        .all
                        .iter()
                        .any(|f| f.windows(part.len()).any(|w| w == part))
                    {
                        pieces.push((e, Kind::Fixed(true, true)));
                    }
                }
            }
        }
        // (a) the line's last piece: a prefix of a fragment.
        for &(e, min) in &ends {
            if e > i && e - i >= min {
                let part = &line[i..e];
                for (f, (os, _)) in frags.starting_with(line[i]) {
                    if f.len() > part.len() && f.starts_with(part) {
                        pieces.push((e, Kind::Fixed(os, true)));
                    }
                }
            }
        }
        // (b) a doc placeholder; (c) a value, one character at a time.
        if let Some(end) = doc_placeholder_end(line, i) {
            pieces.push((end, Kind::Placeholder));
        } else if !line[i].is_whitespace() {
            pieces.push((i + 1, Kind::Value));
        }
        for state in 0..STATES {
            let Some((here, _, _)) = best[i][state] else {
                continue;
            };
            let after_fixed = matches!(state, FIXED_OPEN | FIXED_CLOSED | GLUE_AFTER_VALUE);
            let after_slot = matches!(state, PLACEHOLDER | VALUE);
            for &(end, kind) in &pieces {
                let to = match kind {
                    Kind::Fixed(open_start, open_end) => {
                        if !free(i, end) || word_cut(i) || word_cut(end) {
                            continue;
                        }
                        if after_slot && !open_start {
                            continue;
                        }
                        if glue(&line[i..end]) && matches!(state, VALUE | GLUE_AFTER_VALUE) {
                            GLUE_AFTER_VALUE
                        } else if open_end {
                            FIXED_OPEN
                        } else {
                            FIXED_CLOSED
                        }
                    }
                    Kind::Placeholder if state == FIXED_CLOSED => continue,
                    Kind::Placeholder => PLACEHOLDER,
                    Kind::Value
                        if matches!(state, FIXED_CLOSED | GLUE_AFTER_VALUE)
                            || (after_fixed && word_cut(i)) =>
                    {
                        continue
                    }
                    Kind::Value => VALUE,
                };
                let gain = if matches!(kind, Kind::Fixed(..)) {
                    end - i
                } else {
                    0
                };
                if best[end][to].is_none_or(|(b, _, _)| b < here + gain) {
                    best[end][to] = Some((here + gain, i, state));
                }
            }
        }
    }
    let top = |k: usize| -> Option<(usize, usize)> {
        (0..STATES)
            .filter_map(|state| best[k][state].map(|(v, _, _)| (v, state)))
            .max_by_key(|&(v, state)| (v, std::cmp::Reverse(state)))
    };
    // The best cut, back from the end; neighbouring placeholder and value pieces merged.
    let mut shown_pieces: Vec<(bool, String)> = Vec::new();
    if let Some((_, mut state)) = top(n) {
        let mut k = n;
        while k > 0 {
            let Some((_, from, prev)) = best[k][state] else {
                break;
            };
            let text: String = line[from..k].iter().collect();
            let fixed = matches!(state, FIXED_OPEN | FIXED_CLOSED | GLUE_AFTER_VALUE);
            match shown_pieces.last_mut() {
                Some((false, t)) if !fixed => t.insert_str(0, &text),
                _ => shown_pieces.push((fixed, text)),
            }
            k = from;
            state = prev;
        }
    }
    let shown = shown_pieces
        .iter()
        .rev()
        .map(|(fixed, t)| {
            if *fixed {
                format!("«{t}»")
            } else {
                format!("[{t}]")
            }
        })
        .collect();
    LineCut {
        fixed: top(n).map(|(v, _)| v),
        weight: weight(line),
        reached: (0..=n).rev().find(|&k| top(k).is_some()).unwrap_or(0),
        shown,
    }
}

/// Checks a quoted message: `Ok((fixed characters, the cut shown))`, or why it does not match
/// the code.
fn check(message: &str, frags: &Fragments) -> Result<(usize, String), String> {
    let mut fixed = 0;
    let mut shown = Vec::new();
    let mut weight = 0;
    for (k, line) in message.lines().enumerate() {
        let line: Vec<char> = line.trim().chars().collect();
        if line.is_empty() {
            continue;
        }
        let cut = cut_line(&line, frags);
        let Some(f) = cut.fixed else {
            let done: String = line[..cut.reached].iter().collect();
            let rest: String = line[cut.reached..].iter().collect();
            return Err(format!(
                "its line {} matches the code only up to here: `{done}` ⟦no match from here⟧ `{rest}`",
                k + 1
            ));
        };
        fixed += f;
        weight += cut.weight;
        shown.push(cut.shown);
    }
    if weight == 0 {
        return Err("it is empty".into());
    }
    if 2 * fixed < weight {
        return Err(format!(
            "only {fixed} of its {weight} characters are the code's fixed text (at least half must \
             be; the rest reads as values that placeholders printed)"
        ));
    }
    Ok((fixed, shown.join("\n")))
}

// ---------------------------------------------------------------------------------------------
// The test.

#[test]
fn every_message_quoted_in_troubleshooting_md_is_the_codes() {
    let root = repo();
    let md = std::fs::read_to_string(root.join(DOC)).expect("reading the doc");
    let (quoted, commands) = quotes(&md);
    let (lits, files) = source_literals(&root);
    let frags = Fragments::new(lits.iter().cloned());
    eprintln!(
        "{DOC}: {} quoted messages; skipped as commands: {commands:?}; the code: {} literals in \
         {files} files, {} distinct fixed fragments",
        quoted.len(),
        lits.len(),
        frags.all.len()
    );
    assert!(
        quoted.len() >= 20,
        "too few messages found in {DOC}: {quoted:#?}"
    );
    let mut failures = Vec::new();
    for q in &quoted {
        match check(&q.text, &frags) {
            Ok((fixed, shown)) => eprintln!("ok   {DOC}:{} ({fixed} fixed chars): {shown}", q.line),
            Err(why) => failures.push(format!("{DOC}:{}: `{}`\n    {why}", q.line, q.text)),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} messages quoted in {DOC} are not the code's (quote the literal from the source; \
         `{{…}}` or `…` for a placeholder, or the value it printed):\n{}",
        failures.len(),
        quoted.len(),
        failures.join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// Unit tests of the pieces.

const SAMPLE_SRC: &str = r####"
//! an inner "doc" comment
// a "comment" with a quote
/* block "comment" /* nested "x" */ */
/// a "doc" comment
#[doc = "a doc attribute"]
fn f(v: &str, lt: &'static str) -> String {
    m! {
        /// a "doc" comment in a macro call
        #![doc = "an inner doc attribute in a macro call"]
        x
    }
    let _c = '"';
    let _e = '\'';
    let _raw = r#"raw {x} "quoted""#;
    let _b = b"bytes";
    let m = format!(
        "CRIU {v} is older than the oldest gpu-ckpt supports, {MINIMUM}: install CRIU {MINIMUM} \
         or newer"
    );
    format!("{{literal}} {0:?} and {name:>8}\nsecond line {}", 1, name = lt)
}
"####;

fn sample() -> Fragments {
    Fragments::new(string_literals(SAMPLE_SRC).expect("SAMPLE_SRC parses"))
}

#[test]
fn literals_are_decoded_and_continuations_joined() {
    let lits = string_literals(SAMPLE_SRC).expect("SAMPLE_SRC parses");
    assert_eq!(
        lits,
        vec![
            "raw {x} \"quoted\"".to_string(),
            "bytes".into(),
            "CRIU {v} is older than the oldest gpu-ckpt supports, {MINIMUM}: install CRIU {MINIMUM} or newer".into(),
            "{{literal}} {0:?} and {name:>8}\nsecond line {}".into(),
        ]
    );
}

#[test]
fn literals_are_cut_at_placeholders_and_newlines() {
    assert_eq!(
        fragments("{{literal}} {0:?} and {name:>8}\nsecond line {}"),
        vec!["{literal} ", " and ", "second line "]
    );
    assert_eq!(
        fragments("CRIU {v} is older, {MINIMUM}: ok"),
        vec!["CRIU ", " is older, ", ": ok"]
    );
    // Not a placeholder: JSON-ish text stays.
    assert_eq!(fragments("{\"a\": 1}"), vec!["{\"a\": 1}"]);
}

#[test]
fn a_quoted_message_with_values_and_placeholders_matches() {
    let f = sample();
    let with_values = "CRIU 3.17.1 is older than the oldest gpu-ckpt supports, 4.1.0: install CRIU 4.1.0 or newer";
    assert!(
        check(with_values, &f).is_ok(),
        "{:?}",
        check(with_values, &f)
    );
    let with_placeholders =
        "CRIU {version} is older than the oldest gpu-ckpt supports, {min}: install CRIU {min} or newer";
    assert!(check(with_placeholders, &f).is_ok());
    // Partial pieces: a long enough prefix/suffix of a fragment, or any next to a `…`.
    assert!(check(
        "… is older than the oldest gpu-ckpt supports, 4.1.0: install CRIU …",
        &f
    )
    .is_ok());
    assert!(check("older than the oldest gpu-ckpt", &f).is_ok());
    assert!(check("… than …", &f).is_ok());
    // Multi-line: each line on its own.
    assert!(check("{x} and {y}\nsecond line 7", &f).is_ok());
}

#[test]
fn a_message_with_one_word_changed_fails() {
    let f = sample();
    let changed = "CRIU 3.17.1 is newer than the oldest gpu-ckpt supports, 4.1.0: install CRIU 4.1.0 or newer";
    let err = check(changed, &f).expect_err("a changed word matched");
    assert!(
        err.contains("`CRIU 3.17.1` ⟦no match from here⟧ ` is newer"),
        "{err}"
    );
    // A short partial piece without a `…` next to it is not enough.
    assert!(check("than the", &f).is_err());
}

#[test]
fn a_message_made_of_values_fails() {
    let f = sample();
    let err = check("3.17.1 /usr/local/bin/criu", &f).expect_err("values alone matched");
    assert!(err.contains("no match from here"), "{err}");
    let err =
        check("CRIU 3.17.1-and-a-very-long-version-string", &f).expect_err("mostly values matched");
    assert!(err.contains("fixed text"), "{err}");
}

#[test]
fn pieces_do_not_cut_words_nor_cover_doc_placeholders() {
    let f = sample();
    assert!(check("second line 7", &f).is_ok());
    // `xsecond`: the value `x` and the fragment `second line ` would cut a word.
    let err = check("xsecond line 7", &f).expect_err("a fragment inside a word matched");
    assert!(err.contains("no match from here"), "{err}");
    // A doc placeholder counts as one character, whatever it says, and never as fixed text.
    let (fixed, shown) = check("{second line } and {x}", &f).expect("placeholders and a fragment");
    assert_eq!((fixed, shown.as_str()), (5, "[{second line }]« and »[{x}]"));
}

#[test]
fn values_sit_only_where_the_code_has_placeholders() {
    let f = sample();
    // `second line ` starts a line of its literal: nothing is put before it.
    assert!(check("{x}second line 7", &f).is_err());
    // ` or newer` ends its literal: nothing is put after it.
    let m = "CRIU 3.17.1 is older than the oldest gpu-ckpt supports, 4.1.0: install CRIU 4.1.0 or newer";
    assert!(check(m, &f).is_ok());
    assert!(check(&format!("{m} 5"), &f).is_err());
    assert!(check(&format!("{m}{{x}}"), &f).is_err());
    // Glue (` ` of `{} {}`) does not join values: a changed word is not read as one more value.
    let g = Fragments::new(["{} {}".to_string(), "{} is older".into()]);
    assert!(check("{a} {b} is older", &g).is_ok());
    assert!(check("a b is older", &g).is_err());
}

#[test]
fn only_message_literals_give_fragments() {
    let f = Fragments::new(["criu".to_string(), "{} is {}".into(), "a b".into()]);
    let all: Vec<String> = f.all.iter().map(|c| c.iter().collect()).collect();
    assert_eq!(all, vec![" is ".to_string(), "a b".into()]);
}

#[test]
fn quotes_are_fences_and_the_code_spans_of_bold_quote_headings() {
    let md = "intro `not this`\n\n**Prose heading with `not this either`**\n\n\
              **`first {x}`** and **`second`, or `third`**\n\n\
              **`gpu-ckpt build` says `fourth`**\n\n\
              ```\nblock line 1\nblock line 2\n```\n\n```sh\ngpu-ckpt verify x\n```\n";
    let (q, commands) = quotes(md);
    let texts: Vec<(usize, &str)> = q.iter().map(|q| (q.line, q.text.as_str())).collect();
    assert_eq!(
        texts,
        vec![
            (5, "first {x}"),
            (5, "second"),
            (5, "third"),
            (7, "fourth"),
            (10, "block line 1\nblock line 2"),
        ]
    );
    assert_eq!(commands, vec!["gpu-ckpt build".to_string()]);
}
