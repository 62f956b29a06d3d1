//! `kvbridge explain CODE`: the long explanation of one problem code, from the same catalog as
//! `docs/errors.md`.

use std::process::ExitCode;

use kvbridge_handshake::{catalog, catalog_markdown, explain};

/// Arguments of `kvbridge explain`.
#[derive(Debug, clap::Args)]
pub(crate) struct ExplainArgs {
    /// A problem code such as KVB-E007 (E007, e7 and 7 work too). Without a code, lists all.
    code: Option<String>,
    /// Print the whole catalog (the content of docs/errors.md).
    #[arg(long, conflicts_with = "code")]
    all: bool,
}

fn code_list() -> String {
    let mut out = String::new();
    for i in catalog() {
        out.push_str(&format!("  {}  {}\n", i.id, i.title));
    }
    out
}

pub(crate) fn run(args: ExplainArgs) -> ExitCode {
    if args.all {
        print!("{}", catalog_markdown());
        return ExitCode::SUCCESS;
    }
    match args.code.as_deref() {
        None => {
            print!(
                "Problem codes (kvbridge explain CODE for details):\n{}",
                code_list()
            );
            ExitCode::SUCCESS
        }
        Some(code) => match explain(code) {
            Some(info) => {
                print!("{}", info.to_markdown());
                ExitCode::SUCCESS
            }
            None => {
                eprint!(
                    "kvbridge explain: unknown problem code `{code}`; known codes:\n{}",
                    code_list()
                );
                ExitCode::from(2)
            }
        },
    }
}
