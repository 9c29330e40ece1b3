//! How `gpu-ckpt` prints: kubectl's `-o text|json|yaml` on every subcommand (`--json` is
//! `-o json`), for results and errors alike. A command returns a [`Report`] (its text and its
//! data) or an error; [`print`] and [`print_error`] write it in the format asked for. With json
//! or yaml an error is an object on stdout, with "error", "class" and "exit_code".

use std::io::Write;

use clap::ValueEnum;

use crate::exit::ExitClass;

/// An output format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Format {
    #[default]
    Text,
    Json,
    Yaml,
}

impl Format {
    /// The format that the command line `args` asks for, read without clap: for the errors clap
    /// finds before any subcommand's flags are known.
    pub fn from_args(args: &[String]) -> Format {
        let mut it = args.iter().map(String::as_str).peekable();
        let mut found = Format::Text;
        while let Some(a) = it.next() {
            let value = match a {
                "--json" => Some("json"),
                "-o" | "--output" => it.peek().copied(),
                _ => a
                    .strip_prefix("--output=")
                    .or_else(|| a.strip_prefix("-o=").or_else(|| a.strip_prefix("-o"))),
            };
            match value {
                Some("json") => found = Format::Json,
                Some("yaml") => found = Format::Yaml,
                _ => {}
            }
        }
        found
    }
}

/// The output flag every subcommand takes.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct OutputArgs {
    /// Output format: text, json or yaml. With json or yaml an error is printed that way too,
    /// on stdout: {"error", "class", "exit_code"}.
    #[arg(
        short = 'o',
        long = "output",
        value_enum,
        value_name = "FORMAT",
        default_value = "text"
    )]
    pub output: Format,
    /// The same as -o json.
    #[arg(long, conflicts_with = "output")]
    pub json: bool,
}

impl OutputArgs {
    pub fn format(&self) -> Format {
        if self.json {
            Format::Json
        } else {
            self.output
        }
    }
}

/// What a command found: its text (`-o text`), its data (`-o json|yaml`), and whether the
/// answer is yes ([`ExitClass::Ok`]) or no ([`ExitClass::No`]).
#[derive(Debug)]
pub struct Report {
    pub text: String,
    pub data: serde_json::Value,
    pub class: ExitClass,
}

impl Report {
    pub fn new(text: String, data: serde_json::Value) -> Report {
        Report {
            text,
            data,
            class: ExitClass::Ok,
        }
    }

    /// The same report, its answer no unless `yes`.
    pub fn yes_if(mut self, yes: bool) -> Report {
        self.class = if yes { ExitClass::Ok } else { ExitClass::No };
        self
    }
}

/// Writes `r` to stdout in `format`.
pub fn print(format: Format, r: &Report) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    match format {
        Format::Text => out.write_all(r.text.as_bytes())?,
        _ => out.write_all(render(format, &r.data)?.as_bytes())?,
    }
    out.flush()
}

/// `data` as pretty JSON or as YAML, ending with a newline.
pub fn render(format: Format, data: &serde_json::Value) -> std::io::Result<String> {
    match format {
        Format::Yaml => serde_norway::to_string(data).map_err(std::io::Error::other),
        _ => serde_json::to_string_pretty(data)
            .map(|s| s + "\n")
            .map_err(std::io::Error::other),
    }
}

/// The error and its causes, each said once: a cause whose text the message already holds
/// (an error that prints its source and also returns it as its source) is left out.
pub fn error_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let s = cause.to_string();
        if s.is_empty() || text.contains(&s) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&s);
    }
    text
}

/// Prints the error `text` of class `class`: on stderr after `prefix` for text, else as an
/// object on stdout.
pub fn print_error(format: Format, prefix: &str, text: &str, class: ExitClass) {
    if format == Format::Text {
        eprintln!("{prefix}{text}");
        return;
    }
    let v = serde_json::json!({"error": text, "class": class.name(), "exit_code": class.code()});
    match render(format, &v) {
        Ok(s) => print!("{s}"),
        Err(_) => eprintln!("{prefix}{text}"),
    }
}

/// Lines of text, for a [`Report`].
#[derive(Debug, Default)]
pub struct Text(pub String);

impl Text {
    pub fn line(&mut self, s: impl AsRef<str>) {
        self.0.push_str(s.as_ref());
        self.0.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_that_prints_its_source_says_it_once() {
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        let said = io.to_string();
        let e = anyhow::Error::new(image_format::Error::io("opening", "/x.tar", io))
            .context("inspecting /x.tar");
        let text = error_text(&e);
        assert_eq!(text, format!("inspecting /x.tar: opening /x.tar: {said}"));
        assert_eq!(text.matches(&said).count(), 1);
    }

    #[test]
    fn the_format_is_read_from_any_spelling_of_the_flag() {
        let f = |args: &[&str]| {
            Format::from_args(&args.iter().map(|a| a.to_string()).collect::<Vec<_>>())
        };
        assert_eq!(f(&["verify"]), Format::Text);
        assert_eq!(f(&["verify", "--json"]), Format::Json);
        assert_eq!(f(&["verify", "-o", "yaml"]), Format::Yaml);
        assert_eq!(f(&["verify", "-oyaml"]), Format::Yaml);
        assert_eq!(f(&["verify", "--output=json"]), Format::Json);
        assert_eq!(f(&["verify", "-o", "text"]), Format::Text);
    }
}
