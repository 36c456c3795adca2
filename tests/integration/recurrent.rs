//! The `Recurrent` convention (issue #16): `initial_state(batch)`, a one-step call that takes and
//! returns the state, and a whole-sequence call from a state, for `Lstm`, `Gru`, `LstmCell`,
//! `GruCell` and a derived composite.
//!
//! - The cells match PyTorch: run step by step with the `lstm`/`gru` fixtures' weights (a one-layer
//!   `nn.LSTM`/`nn.GRU` computes exactly `nn.LSTMCell`/`nn.GRUCell` at each step), they reproduce
//!   the fixtures' full-sequence outputs, final states and parameter gradients (tolerance 1e-5,
//!   the fixtures' own).
//! - Running a sequence one step at a time gives the same outputs and final state as the
//!   whole-sequence call, within 1e-6.
//! - States of the wrong shape are typed errors naming both shapes.

use candle_core::Var;
use candle_module::fixtures::max_abs_diff as max_diff;
use candle_module::fixtures::{assert_close, Fixture};
use module_runtime::nn::{Gru, GruCell, Lstm, LstmCell, RnnCellConfig, RnnConfig};
use module_runtime::prelude::*;
use module_runtime::Error;

/// The device under test: `MODULE_DEVICE` (`cuda:0`, …), the CPU when unset.
fn dev() -> Device {
    candle_module::device_from_env().expect("MODULE_DEVICE names a usable device")
}

/// Tolerance of the step-by-step vs whole-sequence comparisons.
const STEP_TOL: f32 = 1e-6;

fn assert_within(what: &str, a: &Tensor, b: &Tensor) {
    let d = max_diff(a, b);
    assert!(
        d <= STEP_TOL,
        "{what}: max |difference| {d:e} > {STEP_TOL:e}"
    );
}

/// Step `t` of a `[batch, time, …]` sequence.
fn at(xs: &Tensor, t: usize) -> Tensor {
    xs.narrow(1, t, 1).unwrap().squeeze(1).unwrap()
}

/// Runs `model` over `xs` `[batch, time, …]` one step at a time from `state`.
fn step_through<M: Recurrent>(model: &M, xs: &Tensor, state: M::State) -> (Tensor, M::State) {
    let mut state = state;
    let mut ys = Vec::new();
    for t in 0..xs.dim(1).unwrap() {
        let (y, next) = model.step(&at(xs, t), state).unwrap();
        ys.push(y);
        state = next;
    }
    (Tensor::stack(&ys, 1).unwrap(), state)
}

/// Copies a one-layer fixture's `param.<name>_l0` into the cell's `<name>`.
fn load_cell_from_layer_fixture(fx: &Fixture, cell: &dyn Module) {
    for (name, p) in cell.named_parameters() {
        p.set(&fx.get(&format!("param.{name}_l0"))).unwrap();
    }
}

/// Backpropagates `(output * upstream).sum()` and compares each cell parameter's gradient with
/// the fixture's gradient of the layer's `<name>_l0`, and the input's.
fn check_cell_backward(fx: &Fixture, cell: &dyn Module, input: &Var, output: &Tensor) {
    let loss = (output * fx.get("upstream")).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    assert_close(
        "grad.input",
        grads.get(input.as_tensor()).expect("input gradient"),
        &fx.get("grad.input"),
    );
    for (name, p) in cell.named_parameters() {
        let grad = grads
            .get(p.var().unwrap().as_tensor())
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        assert_close(
            &format!("grad.{name}"),
            grad,
            &fx.get(&format!("grad.param.{name}_l0")),
        );
    }
}

#[test]
fn lstm_cell_step_by_step_matches_pytorch_lstm() {
    let fx = Fixture::load("lstm");
    let cell = LstmCell::new(4, 6, &dev()).unwrap();
    load_cell_from_layer_fixture(&fx, &cell);
    let x = Var::from_tensor(&fx.get("input")).unwrap(); // [2, 5, 4], batch first
    let (mut h, mut c) = cell.initial_state(2).unwrap();
    let mut ys = Vec::new();
    for t in 0..5 {
        // PyTorch's `h, c = cell(x[:, t], (h, c))`.
        (h, c) = cell.call((&at(x.as_tensor(), t), (&h, &c))).unwrap();
        ys.push(h.clone());
    }
    let y = Tensor::stack(&ys, 1).unwrap();
    assert_close("output", &y, &fx.get("output"));
    assert_close("h_n", &h, &fx.get("output.h").squeeze(0).unwrap());
    assert_close("c_n", &c, &fx.get("output.c").squeeze(0).unwrap());
    check_cell_backward(&fx, &cell, &x, &y);
    fx.assert_all_used();
}

#[test]
fn gru_cell_step_by_step_matches_pytorch_gru() {
    let fx = Fixture::load("gru");
    let cell = GruCell::new(4, 6, &dev()).unwrap();
    load_cell_from_layer_fixture(&fx, &cell);
    let x = Var::from_tensor(&fx.get("input")).unwrap();
    let mut h = cell.call(&at(x.as_tensor(), 0)).unwrap(); // from zeros
    let mut ys = vec![h.clone()];
    for t in 1..5 {
        h = cell.call((&at(x.as_tensor(), t), &h)).unwrap();
        ys.push(h.clone());
    }
    let y = Tensor::stack(&ys, 1).unwrap();
    assert_close("output", &y, &fx.get("output"));
    assert_close("h_n", &h, &fx.get("output.h").squeeze(0).unwrap());
    check_cell_backward(&fx, &cell, &x, &y);
    fx.assert_all_used();
}

/// The cells' `Recurrent::scan` (the trait's default loop) against the fixtures, from a zero state.
#[test]
fn cell_scan_matches_the_fixtures() {
    let fx = Fixture::load("lstm");
    let cell = LstmCell::new(4, 6, &dev()).unwrap();
    load_cell_from_layer_fixture(&fx, &cell);
    let (y, (h, c)) = cell
        .scan(&fx.get("input"), cell.initial_state(2).unwrap())
        .unwrap();
    assert_close("lstm output", &y, &fx.get("output"));
    assert_close("lstm h_n", &h, &fx.get("output.h").squeeze(0).unwrap());
    assert_close("lstm c_n", &c, &fx.get("output.c").squeeze(0).unwrap());

    let fx = Fixture::load("gru");
    let cell = GruCell::new(4, 6, &dev()).unwrap();
    load_cell_from_layer_fixture(&fx, &cell);
    let (y, h) = cell
        .scan(&fx.get("input"), cell.initial_state(2).unwrap())
        .unwrap();
    assert_close("gru output", &y, &fx.get("output"));
    assert_close("gru h_n", &h, &fx.get("output.h").squeeze(0).unwrap());
}

#[test]
fn cell_parameters_have_pytorch_names_shapes_and_init() {
    let dev = dev();
    let lstm = LstmCell::new(3, 5, &dev).unwrap();
    let shapes: Vec<(String, Vec<usize>)> = lstm
        .named_parameters()
        .into_iter()
        .map(|(n, p)| (n, p.shape().dims().to_vec()))
        .collect();
    assert_eq!(
        shapes,
        [
            ("weight_ih".to_owned(), vec![20, 3]),
            ("weight_hh".to_owned(), vec![20, 5]),
            ("bias_ih".to_owned(), vec![20]),
            ("bias_hh".to_owned(), vec![20]),
        ]
    );
    // Uniform on ±1/sqrt(hidden_size), like PyTorch's RNNCellBase.reset_parameters.
    let bound = 1.0 / (5f32).sqrt();
    for (name, p) in lstm.named_parameters() {
        let max = p
            .tensor()
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap();
        assert!(
            max.to_scalar::<f32>().unwrap() <= bound,
            "{name} out of range"
        );
    }
    let gru = GruCell::with_config(
        3,
        5,
        RnnCellConfig {
            bias: false,
            dtype: DType::F64,
        },
        &dev,
    )
    .unwrap();
    let names: Vec<String> = gru.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["weight_ih", "weight_hh"]);
    assert_eq!(
        gru.get_parameter("weight_hh").unwrap().shape().dims(),
        [15, 5]
    );
    assert_eq!(gru.initial_state(2).unwrap().dtype(), DType::F64);
    assert_eq!((gru.input_size(), gru.hidden_size()), (3, 5));
    // A state dict round trip by PyTorch's names.
    let other = GruCell::with_config(
        3,
        5,
        RnnCellConfig {
            bias: false,
            dtype: DType::F64,
        },
        &dev,
    )
    .unwrap();
    other
        .load_state_dict(&gru.state_dict().unwrap(), &LoadOptions::default())
        .unwrap();
    let x = Tensor::randn(0f64, 1., (2, 3), &dev).unwrap();
    assert_within(
        "reloaded cell",
        &gru.call(&x).unwrap().to_dtype(DType::F32).unwrap(),
        &other.call(&x).unwrap().to_dtype(DType::F32).unwrap(),
    );
}

/// A one-layer `Lstm`/`Gru` and a cell with the same weights compute the same thing.
#[test]
fn a_one_layer_rnn_is_its_cell_looped() {
    let dev = dev();
    let xs = Tensor::randn(0f32, 1., (3, 7, 4), &dev).unwrap();
    let batch_first = RnnConfig {
        batch_first: true,
        ..Default::default()
    };
    let lstm = Lstm::with_config(4, 6, batch_first, &dev).unwrap();
    let cell = LstmCell::new(4, 6, &dev).unwrap();
    for (name, p) in cell.named_parameters() {
        p.set(
            &lstm
                .get_parameter(&format!("{name}_l0"))
                .unwrap()
                .tensor()
                .unwrap(),
        )
        .unwrap();
    }
    let (y, (h, c)) = lstm.call(&xs).unwrap();
    let (y_cell, (h_cell, c_cell)) = step_through(&cell, &xs, cell.initial_state(3).unwrap());
    assert_within("lstm output", &y, &y_cell);
    assert_within("lstm h", &h.squeeze(0).unwrap(), &h_cell);
    assert_within("lstm c", &c.squeeze(0).unwrap(), &c_cell);

    let gru = Gru::with_config(4, 6, batch_first, &dev).unwrap();
    let cell = GruCell::new(4, 6, &dev).unwrap();
    for (name, p) in cell.named_parameters() {
        p.set(
            &gru.get_parameter(&format!("{name}_l0"))
                .unwrap()
                .tensor()
                .unwrap(),
        )
        .unwrap();
    }
    let (y, h) = gru.call(&xs).unwrap();
    let (y_cell, h_cell) = step_through(&cell, &xs, cell.initial_state(3).unwrap());
    assert_within("gru output", &y, &y_cell);
    assert_within("gru h", &h.squeeze(0).unwrap(), &h_cell);
}

/// The acceptance test: stepping gives the whole-sequence outputs and final state
/// (within 1e-6), for stacked layers in PyTorch's default `[seq, batch, feature]` layout, from a
/// non-zero state, through `forward` and through `scan`.
#[test]
fn stepping_an_lstm_matches_the_whole_sequence() {
    let dev = dev();
    let config = RnnConfig {
        num_layers: 2,
        ..Default::default()
    };
    let lstm = Lstm::with_config(4, 6, config, &dev).unwrap();
    let xs = Tensor::randn(0f32, 1., (3, 9, 4), &dev).unwrap(); // [B, T, F]
    let h0 = Tensor::randn(0f32, 1., (2, 3, 6), &dev).unwrap();
    let c0 = Tensor::randn(0f32, 1., (2, 3, 6), &dev).unwrap();

    // forward in the layer's layout, [T, B, F].
    let (y, (h, c)) = lstm
        .call((&xs.transpose(0, 1).unwrap(), (&h0, &c0)))
        .unwrap();
    let y = y.transpose(0, 1).unwrap();
    let (y_steps, (h_steps, c_steps)) = step_through(&lstm, &xs, (h0.clone(), c0.clone()));
    assert_within("output", &y, &y_steps);
    assert_within("h_n", &h, &h_steps);
    assert_within("c_n", &c, &c_steps);

    // scan, always [B, T, F].
    let (y_scan, (h_scan, c_scan)) = lstm.scan(&xs, (h0, c0)).unwrap();
    assert_within("scan output", &y, &y_scan);
    assert_within("scan h_n", &h, &h_scan);
    assert_within("scan c_n", &c, &c_scan);

    // Two halves, the second from the first's final state, are the whole.
    let (y1, s1) = lstm
        .scan(&xs.narrow(1, 0, 4).unwrap(), lstm.initial_state(3).unwrap())
        .unwrap();
    let (y2, (h2, c2)) = lstm.scan(&xs.narrow(1, 4, 5).unwrap(), s1).unwrap();
    let (y_all, (h_all, c_all)) = lstm.call(&xs.transpose(0, 1).unwrap()).unwrap();
    assert_within(
        "halves output",
        &Tensor::cat(&[y1, y2], 1).unwrap(),
        &y_all.transpose(0, 1).unwrap(),
    );
    assert_within("halves h_n", &h2, &h_all);
    assert_within("halves c_n", &c2, &c_all);
}

#[test]
fn stepping_a_gru_matches_the_whole_sequence() {
    let dev = dev();
    let config = RnnConfig {
        num_layers: 3,
        batch_first: true,
        bias: false,
        ..Default::default()
    };
    let gru = Gru::with_config(5, 4, config, &dev).unwrap();
    let xs = Tensor::randn(0f32, 1., (2, 6, 5), &dev).unwrap();
    let h0 = Tensor::randn(0f32, 1., (3, 2, 4), &dev).unwrap();
    let (y, h) = gru.call((&xs, &h0)).unwrap();
    let (y_steps, h_steps) = step_through(&gru, &xs, h0.clone());
    assert_within("output", &y, &y_steps);
    assert_within("h_n", &h, &h_steps);
    let (y_scan, h_scan) = gru.scan(&xs, h0).unwrap();
    assert_within("scan output", &y, &y_scan);
    assert_within("scan h_n", &h, &h_scan);
}

/// Unbatched inputs, like PyTorch: `[input_size]` steps with `[hidden]` / `[num_layers, hidden]`
/// states.
#[test]
fn unbatched_steps() {
    let dev = dev();
    let cell = LstmCell::new(4, 6, &dev).unwrap();
    let x = Tensor::randn(0f32, 1., (2, 4), &dev).unwrap();
    let (h, c) = cell.call(&x).unwrap();
    let (h1, c1) = cell.call(&x.get(1).unwrap()).unwrap();
    assert_eq!(h1.dims(), [6]);
    assert_within("unbatched h", &h1, &h.get(1).unwrap());
    assert_within("unbatched c", &c1, &c.get(1).unwrap());

    let lstm = Lstm::new(4, 6, &dev).unwrap();
    let zeros = Tensor::zeros((1, 6), DType::F32, &dev).unwrap();
    let (y, (h, _)) = lstm
        .step(&x.get(0).unwrap(), (zeros.clone(), zeros))
        .unwrap();
    assert_eq!((y.dims(), h.dims()), ([6].as_slice(), [1, 6].as_slice()));
    let (y_batched, _) = lstm.step(&x, lstm.initial_state(2).unwrap()).unwrap();
    assert_within("unbatched layer step", &y, &y_batched.get(0).unwrap());
}

/// A derived model of recurrent parts has its parts' states as its state (here a tuple).
#[derive(Module)]
struct Tagger {
    encoder: Lstm,
    decoder: GruCell,
    head: Linear,
}

impl Recurrent for Tagger {
    type State = ((Tensor, Tensor), Tensor);

    fn initial_state(&self, batch: usize) -> Result<Self::State> {
        Ok((
            self.encoder.initial_state(batch)?,
            self.decoder.initial_state(batch)?,
        ))
    }

    fn step(&self, x: &Tensor, (enc, dec): Self::State) -> Result<(Tensor, Self::State)> {
        let (h, enc) = self.encoder.step(x, enc)?;
        let (h, dec) = self.decoder.step(&h, dec)?;
        Ok((self.head.call(&h)?, (enc, dec)))
    }
}

#[test]
fn a_derived_composite_threads_its_parts_states() {
    let dev = dev();
    let config = RnnConfig {
        num_layers: 2,
        ..Default::default()
    };
    let model = Tagger {
        encoder: Lstm::with_config(3, 8, config, &dev).unwrap(),
        decoder: GruCell::new(8, 5, &dev).unwrap(),
        head: Linear::new(5, 2, &dev).unwrap(),
    };
    let xs = Tensor::randn(0f32, 1., (4, 6, 3), &dev).unwrap();
    let ((h0, c0), d0) = model.initial_state(4).unwrap();
    assert_eq!(
        (h0.dims(), c0.dims(), d0.dims()),
        (
            [2, 4, 8].as_slice(),
            [2, 4, 8].as_slice(),
            [4, 5].as_slice()
        )
    );
    let (ys, ((h, c), d)) = model.scan(&xs, model.initial_state(4).unwrap()).unwrap();
    assert_eq!(ys.dims(), [4, 6, 2]);
    // The encoder's part of the state is what the encoder alone ends in.
    let (_, (h_enc, c_enc)) = model
        .encoder
        .scan(&xs, model.encoder.initial_state(4).unwrap())
        .unwrap();
    assert_within("encoder h", &h, &h_enc);
    assert_within("encoder c", &c, &c_enc);
    assert_eq!(d.dims(), [4, 5]);
    // Parameter names nest as usual.
    assert!(model
        .named_parameters()
        .iter()
        .any(|(n, _)| n == "decoder.weight_hh"));
    assert!(model
        .named_parameters()
        .iter()
        .any(|(n, _)| n == "encoder.weight_ih_l1"));
}

fn expect_shape_error(err: Error, expected: &[&str]) {
    let msg = err.to_string();
    assert!(
        matches!(err.inner(), Error::InputShape { .. }),
        "not an InputShape error: {msg}"
    );
    for part in expected {
        assert!(msg.contains(part), "`{msg}` does not mention `{part}`");
    }
}

#[test]
fn states_of_the_wrong_shape_are_errors_naming_the_shapes() {
    let dev = dev();
    let lstm = Lstm::new(4, 6, &dev).unwrap();
    let x = Tensor::zeros((5, 2, 4), DType::F32, &dev).unwrap(); // [T, B, F]
                                                                 // Same number of elements as [1, 2, 6], so a reshape would have hidden the mistake.
    let h0 = Tensor::zeros((2, 6), DType::F32, &dev).unwrap();
    let c0 = Tensor::zeros((1, 2, 6), DType::F32, &dev).unwrap();
    let err = lstm.forward((&x, (&h0, &c0))).unwrap_err();
    expect_shape_error(err, &["Lstm h_0", "[1, 2, 6]", "[2, 6]"]);
    let err = lstm.forward((&x, (&c0, &h0))).unwrap_err();
    expect_shape_error(err, &["Lstm c_0", "[1, 2, 6]"]);
    // Through `call`, the error keeps its kind under the `Forward` frame.
    let err = lstm.call((&x, (&h0, &c0))).unwrap_err();
    expect_shape_error(err, &["[1, 2, 6]"]);
    // A state for another batch size.
    let err = lstm
        .step(&x.get(0).unwrap(), lstm.initial_state(3).unwrap())
        .unwrap_err();
    expect_shape_error(err, &["[1, 2, 6]", "[1, 3, 6]"]);

    let gru = Gru::new(4, 6, &dev).unwrap();
    let err = gru
        .forward((&x, &Tensor::zeros((2, 2, 6), DType::F32, &dev).unwrap()))
        .unwrap_err();
    expect_shape_error(err, &["Gru h_0", "[1, 2, 6]", "[2, 2, 6]"]);

    let cell = LstmCell::new(4, 6, &dev).unwrap();
    let xb = Tensor::zeros((2, 4), DType::F32, &dev).unwrap();
    let (h, c) = cell.initial_state(2).unwrap();
    let err = cell.step(&xb, (h, c.narrow(1, 0, 5).unwrap())).unwrap_err();
    expect_shape_error(err, &["LstmCell c", "[2, 6]", "[2, 5]"]);
    let err = GruCell::new(4, 6, &dev)
        .unwrap()
        .step(&xb, Tensor::zeros(6, DType::F32, &dev).unwrap())
        .unwrap_err();
    expect_shape_error(err, &["GruCell h", "[2, 6]", "[6]"]);
}

#[test]
fn inputs_of_the_wrong_shape_are_errors() {
    let dev = dev();
    let lstm = Lstm::new(4, 6, &dev).unwrap();
    let err = lstm
        .forward(&Tensor::zeros((5, 2, 3), DType::F32, &dev).unwrap())
        .unwrap_err();
    expect_shape_error(err, &["Lstm", "[seq, batch, 4]", "[5, 2, 3]"]);
    // `step` takes one time step, `scan` a batch-first sequence.
    let err = lstm
        .step(
            &Tensor::zeros((2, 1, 4), DType::F32, &dev).unwrap(),
            lstm.initial_state(2).unwrap(),
        )
        .unwrap_err();
    expect_shape_error(err, &["[batch, 4]", "[2, 1, 4]"]);
    let err = lstm
        .scan(
            &Tensor::zeros((2, 4), DType::F32, &dev).unwrap(),
            lstm.initial_state(2).unwrap(),
        )
        .unwrap_err();
    expect_shape_error(err, &["[batch, time >= 1, 4]", "[2, 4]"]);
    let cell = GruCell::new(4, 6, &dev).unwrap();
    let err = cell
        .forward(&Tensor::zeros((2, 5), DType::F32, &dev).unwrap())
        .unwrap_err();
    expect_shape_error(err, &["GruCell", "[batch, 4]", "[2, 5]"]);
    // The trait's default `scan` wants a time axis with at least one step.
    let err = cell
        .scan(
            &Tensor::zeros((2, 0, 4), DType::F32, &dev).unwrap(),
            cell.initial_state(2).unwrap(),
        )
        .unwrap_err();
    expect_shape_error(err, &["time >= 1"]);
    // Zero layers is a configuration error, as in PyTorch.
    let err = Lstm::with_config(
        4,
        6,
        RnnConfig {
            num_layers: 0,
            ..Default::default()
        },
        &dev,
    )
    .unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
}

/// Hooks see a cell's call like any module's: input `(x, (h, c))`, output `(h', c')`.
#[test]
fn cell_calls_fire_hooks() {
    let dev = dev();
    let cell = LstmCell::new(4, 6, &dev).unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    let hooks = Hooks::new();
    hooks.register_global_forward_hook(
        move |_ctx, input, output| {
            log.lock().unwrap().push((input.len(), output.len()));
            Ok(None)
        },
        HookOptions::default(),
    );
    let x = Tensor::zeros((2, 4), DType::F32, &dev).unwrap();
    let (h, c) = cell.initial_state(2).unwrap();
    hooks.run(&cell, |m| m.call((&x, (&h, &c)))).unwrap();
    assert_eq!(*seen.lock().unwrap(), [(3, 2)]);
}
