use module_runtime::candle_core::Tensor;
use module_runtime::nn::{LayerNorm, Linear};
use module_runtime::{HookOptions, Hooks, Module};

#[derive(Module)]
#[module(paths)]
struct Net {
    fc: Linear,
    norm: LayerNorm,
}

fn main() {
    let hooks = Hooks::new();
    // The input is a borrowed form: typed hooks take the owned one (`&Tensor`, i.e. `Tensor`).
    let _ = hooks.register_typed_hook(&Net::path().fc(), |_, _: &Linear, _: &&Tensor, _: &Tensor| {
        Ok(None)
    }, HookOptions::default());
    // The module is not the path's.
    let _ = hooks.register_typed_hook(&Net::path().fc(), |_, _: &LayerNorm, _: &Tensor, _: &Tensor| {
        Ok(None)
    }, HookOptions::default());
}
