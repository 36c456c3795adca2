//! The dataflow graph of the digits classifier ([`DigitNet`]) from one traced call, written as
//! Graphviz DOT and rendered to SVG when Graphviz's `dot` is installed (the picture in the README,
//! `docs/digits_dataflow.svg`, is this example's output).
//!
//! ```text
//! cargo run --example dataflow_digits -- [OUT.svg|OUT.png] [--depth N]
//! ```
//!
//! Without `dot` on `PATH` it still writes `OUT.dot` and says how to render it.

use candle_module::DigitNet;
use module_runtime::prelude::*;

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let mut out = std::path::PathBuf::from("digits_dataflow.svg");
    let mut depth = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--depth" => depth = Some(args.next().ok_or("--depth needs a number")?.parse()?),
            "-h" | "--help" => {
                println!("usage: dataflow_digits [OUT.svg|OUT.png] [--depth N]");
                return Ok(());
            }
            path => out = path.into(),
        }
    }
    let device = Device::Cpu;
    let model = DigitNet::new(&device)?;
    model.eval();
    let batch = Tensor::zeros((32, 64), DType::F32, &device)?;
    let mut graph = model.dataflow(|m| m.call(&batch))?;
    if let Some(depth) = depth {
        graph = graph.collapse(depth);
    }
    print!("{graph}");

    let dot_path = out.with_extension("dot");
    std::fs::write(&dot_path, graph.to_dot())?;
    println!("wrote {}", dot_path.display());
    match graph.render(&out) {
        Ok(()) => println!("wrote {}", out.display()),
        Err(e @ Error::GraphvizNotFound { .. }) => eprintln!("{e}"),
        Err(e) => return Err(e.into()),
    }
    Ok(())
}
