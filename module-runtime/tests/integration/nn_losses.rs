//! PyTorch's losses and distances as modules (issue 29), with their options, forward and input
//! gradients against the fixtures of `fixtures/make_nn_fixtures.py` (class weights and
//! `pos_weight` load from the fixtures' state dicts by PyTorch's names); and their errors.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use module_runtime::nn::{
    AdaptiveLogSoftmaxConfig, AdaptiveLogSoftmaxWithLoss, BCELoss, BCEWithLogitsLoss, CTCLoss,
    ClassLossConfig, CosineEmbeddingLoss, CosineSimilarity, CrossEntropyLoss, GaussianNLLLoss,
    HingeEmbeddingLoss, HuberLoss, KLDivLoss, KLDivReduction, L1Loss, LinearCrossEntropyConfig,
    LinearCrossEntropyLoss, LogSoftmax, LossReduction, MSELoss, MarginRankingLoss,
    MultiLabelMarginLoss, MultiLabelSoftMarginLoss, MultiMarginLoss, NLLLoss, PairwiseDistance,
    PoissonNLLLoss, SmoothL1Loss, SoftMarginLoss, TripletMarginLoss, TripletMarginWithDistanceLoss,
};
use module_runtime::{Error, Module, ModuleExt, Result};

use crate::nn_fixture::check;

/// Checks a loss of `(input, target)`.
fn check_pair<L>(case: &str, loss: &L)
where
    L: Module + for<'a> module_runtime::Forward<(&'a Tensor, &'a Tensor), Output = Tensor>,
{
    check(case, loss, &["input", "target"], |t| {
        loss.call((&t[0], &t[1]))
    });
}

/// A `[5]` placeholder for class weights; the fixture's values replace it.
fn five() -> Option<Tensor> {
    Some(Tensor::ones(5, DType::F32, &Device::Cpu).unwrap())
}

#[test]
fn cross_entropy_matches_pytorch() -> Result<()> {
    let dev = Device::Cpu;
    check_pair("cross_entropy", &CrossEntropyLoss::new());
    let options = ClassLossConfig {
        weight: five(),
        ignore_index: 2,
        label_smoothing: 0.1,
        ..Default::default()
    };
    check_pair(
        "cross_entropy_options",
        &CrossEntropyLoss::with_config(options, &dev)?,
    );
    let none = ClassLossConfig {
        reduction: LossReduction::None,
        ..Default::default()
    };
    check_pair(
        "cross_entropy_none",
        &CrossEntropyLoss::with_config(none, &dev)?,
    );
    let probs = ClassLossConfig {
        reduction: LossReduction::Sum,
        label_smoothing: 0.2,
        ..Default::default()
    };
    check_pair(
        "cross_entropy_probs",
        &CrossEntropyLoss::with_config(probs, &dev)?,
    );
    Ok(())
}

#[test]
fn linear_cross_entropy_matches_pytorch() -> Result<()> {
    let dev = Device::Cpu;
    check_pair(
        "linear_cross_entropy",
        &LinearCrossEntropyLoss::new(6, 5, &dev)?,
    );
    let options = LinearCrossEntropyConfig {
        out_features: vec![3],
        bias: true,
        weight: five(),
        ignore_index: Some(2),
        label_smoothing: 0.1,
        reduction: LossReduction::Sum,
    };
    let head = LinearCrossEntropyLoss::with_config(6, 5, options, &dev)?;
    let state = head.state_dict()?;
    let keys: Vec<&str> = state.keys().collect();
    assert_eq!(keys, ["weight", "linear.weight", "linear.bias"]);
    check_pair("linear_cross_entropy_options", &head);
    let bad = LinearCrossEntropyConfig {
        label_smoothing: 1.5,
        ..Default::default()
    };
    let err = LinearCrossEntropyLoss::with_config(6, 5, bad, &dev).unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
    Ok(())
}

#[test]
fn nll_and_binary_losses_match_pytorch() -> Result<()> {
    let dev = Device::Cpu;
    check_pair("nll", &NLLLoss::new());
    let options = ClassLossConfig {
        weight: five(),
        ignore_index: 1,
        ..Default::default()
    };
    check_pair("nll_options", &NLLLoss::with_config(options, &dev)?);
    check_pair("bce", &BCELoss::new());
    check_pair(
        "bce_weight_sum",
        &BCELoss::with_config(five(), LossReduction::Sum),
    );
    check_pair("bce_with_logits", &BCEWithLogitsLoss::new());
    let options = BCEWithLogitsLoss::with_config(five(), five(), LossReduction::None);
    check_pair("bce_with_logits_options", &options);
    Ok(())
}

#[test]
fn regression_losses_match_pytorch() {
    check_pair("mse", &MSELoss::new());
    check_pair("mse_none", &MSELoss::with_reduction(LossReduction::None));
    check_pair("l1_sum", &L1Loss::with_reduction(LossReduction::Sum));
    check_pair(
        "smooth_l1",
        &SmoothL1Loss::with_beta(0.5, LossReduction::Mean),
    );
    check_pair("huber", &HuberLoss::with_delta(1.5, LossReduction::Mean));
    let batchmean = KLDivLoss::with_reduction(KLDivReduction::BatchMean);
    check_pair("kl_div", &batchmean);
    check_pair(
        "kl_div_log_target",
        &KLDivLoss {
            reduction: KLDivReduction::None,
            log_target: true,
        },
    );
}

#[test]
fn distances_and_margin_losses_match_pytorch() {
    let cos = CosineSimilarity::new();
    check("cosine_similarity", &cos, &["x1", "x2"], |t| {
        cos.call((&t[0], &t[1]))
    });
    let dist = PairwiseDistance::new();
    check("pairwise_distance", &dist, &["x1", "x2"], |t| {
        dist.call((&t[0], &t[1]))
    });
    let p1 = PairwiseDistance {
        keepdim: true,
        ..PairwiseDistance::with_norm(1.0)
    };
    check("pairwise_distance_p1_keepdim", &p1, &["x1", "x2"], |t| {
        p1.call((&t[0], &t[1]))
    });

    let names = ["input1", "input2", "target"];
    let emb = CosineEmbeddingLoss::with_config(0.2, LossReduction::Mean);
    check("cosine_embedding", &emb, &names, |t| {
        emb.call((&t[0], &t[1], &t[2]))
    });
    let rank = MarginRankingLoss::with_config(0.3, LossReduction::Mean);
    check("margin_ranking", &rank, &names, |t| {
        rank.call((&t[0], &t[1], &t[2]))
    });

    let names = ["anchor", "positive", "negative"];
    let triplet = TripletMarginLoss::new();
    check("triplet_margin", &triplet, &names, |t| {
        triplet.call((&t[0], &t[1], &t[2]))
    });
    let with_distance = TripletMarginWithDistanceLoss::new();
    check(
        "triplet_margin_with_distance",
        &with_distance,
        &names,
        |t| with_distance.call((&t[0], &t[1], &t[2])),
    );
    let cosine = CosineSimilarity::new();
    let cosine_distance = TripletMarginWithDistanceLoss {
        distance_function: Some(Arc::new(move |x: &Tensor, y: &Tensor| {
            Ok(cosine.call((x, y))?.affine(-1.0, 1.0)?)
        })),
        margin: 0.5,
        swap: true,
        reduction: LossReduction::Sum,
    };
    check(
        "triplet_margin_with_cosine_distance",
        &cosine_distance,
        &names,
        |t| cosine_distance.call((&t[0], &t[1], &t[2])),
    );
    let swap = TripletMarginLoss {
        margin: 2.0,
        norm: 1.0,
        swap: true,
        reduction: LossReduction::None,
        ..Default::default()
    };
    check("triplet_margin_swap", &swap, &names, |t| {
        swap.call((&t[0], &t[1], &t[2]))
    });
}

#[test]
fn margin_and_likelihood_losses_match_pytorch() -> Result<()> {
    check_pair(
        "hinge_embedding",
        &HingeEmbeddingLoss::with_config(0.5, LossReduction::Mean),
    );
    check_pair(
        "soft_margin",
        &SoftMarginLoss::with_reduction(LossReduction::Sum),
    );
    let weighted = MultiLabelSoftMarginLoss::with_config(five(), LossReduction::Mean);
    check_pair("multilabel_soft_margin", &weighted);
    check_pair("multi_margin", &MultiMarginLoss::new());
    check_pair("multilabel_margin", &MultiLabelMarginLoss::new());
    let options = MultiMarginLoss::with_config(2, 0.5, five(), LossReduction::None)?;
    check_pair("multi_margin_options", &options);
    check_pair("poisson_nll", &PoissonNLLLoss::new());
    let full = PoissonNLLLoss {
        log_input: false,
        full: true,
        reduction: LossReduction::Sum,
        ..Default::default()
    };
    check_pair("poisson_nll_full", &full);
    let names = ["input", "target", "var"];
    let gauss = GaussianNLLLoss::new();
    check("gaussian_nll", &gauss, &names, |t| {
        gauss.call((&t[0], &t[1], &t[2]))
    });
    let per_sample = GaussianNLLLoss {
        full: true,
        reduction: LossReduction::None,
        ..Default::default()
    };
    check("gaussian_nll_per_sample", &per_sample, &names, |t| {
        per_sample.call((&t[0], &t[1], &t[2]))
    });
    assert!(MultiMarginLoss::with_config(3, 1.0, None, LossReduction::Mean).is_err());
    Ok(())
}

#[test]
fn ctc_matches_pytorch_after_a_log_softmax() {
    let names = ["logits", "targets", "input_lengths", "target_lengths"];
    let log_softmax = LogSoftmax::new(-1);
    for (case, ctc) in [
        ("ctc", CTCLoss::new()),
        (
            "ctc_concatenated",
            CTCLoss {
                reduction: LossReduction::None,
                zero_infinity: true,
                ..CTCLoss::with_blank(4)
            },
        ),
    ] {
        check(case, &ctc, &names, |t| {
            let log_probs = log_softmax.call(&t[0])?;
            ctc.call((&log_probs, &t[1], &t[2], &t[3]))
        });
    }
}

#[test]
fn ctc_errors_name_the_shapes_and_impossible_alignments_are_infinite() -> Result<()> {
    let dev = Device::Cpu;
    let lp = Tensor::zeros((4, 2, 3), DType::F32, &dev)?;
    let targets = Tensor::new(&[[1i64, 1], [2, 0]], &dev)?;
    let lengths = Tensor::new(&[4i64, 4], &dev)?;
    let err = CTCLoss::new()
        .call((&lp, &targets, &lengths, &Tensor::new(&[2i64], &dev)?))
        .unwrap_err();
    assert!(err.to_string().contains("[2] integer lengths"), "{err}");
    let too_long = Tensor::new(&[5i64, 4], &dev)?;
    let err = CTCLoss::new()
        .call((&lp, &targets, &too_long, &Tensor::new(&[2i64, 1], &dev)?))
        .unwrap_err();
    assert!(err.to_string().contains("T = 4"), "{err}");
    // Two equal labels need three frames; two frames cannot hold them.
    let short = Tensor::new(&[2i64, 4], &dev)?;
    let loss = CTCLoss {
        reduction: LossReduction::None,
        ..CTCLoss::new()
    }
    .call((&lp, &targets, &short, &Tensor::new(&[2i64, 1], &dev)?))?
    .to_vec1::<f32>()?;
    assert!(loss[0].is_infinite() && loss[1].is_finite(), "{loss:?}");
    // Concatenated lengths that add up but reach past the labels, and empty sequences.
    let flat = Tensor::new(&[1i64, 2, 1], &dev)?;
    let err = CTCLoss::new()
        .call((&lp, &flat, &lengths, &Tensor::new(&[5i64, -2], &dev)?))
        .unwrap_err();
    assert!(err.to_string().contains("target length 5"), "{err}");
    let none = Tensor::new(&[0i64, 0], &dev)?;
    let loss = CTCLoss {
        reduction: LossReduction::Sum,
        ..CTCLoss::new()
    }
    .call((&lp, &targets, &none, &none))?
    .to_scalar::<f32>()?;
    assert_eq!(loss, 0.0);
    Ok(())
}

#[test]
fn adaptive_log_softmax_matches_pytorch() -> Result<()> {
    let dev = Device::Cpu;
    let half = AdaptiveLogSoftmaxConfig {
        div_value: 2.0,
        ..Default::default()
    };
    let half_with_bias = AdaptiveLogSoftmaxConfig {
        head_bias: true,
        ..half
    };
    let asm = AdaptiveLogSoftmaxWithLoss::with_config(8, 10, &[3, 6], half_with_bias, &dev)?;
    let names: Vec<String> = asm.named_parameters().into_iter().map(|(n, _)| n).collect();
    let expected = [
        "head.weight",
        "head.bias",
        "tail.0.0.weight",
        "tail.0.1.weight",
        "tail.1.0.weight",
        "tail.1.1.weight",
    ];
    assert_eq!(names, expected);
    // The fixture's output is `cat([output, loss])`, both parts of PyTorch's `_ASMoutput`.
    check("adaptive_log_softmax", &asm, &["input", "target"], |t| {
        let (output, loss) = asm.call((&t[0], &t[1]))?;
        Ok(Tensor::cat(&[output, loss.unsqueeze(0)?], 0)?)
    });
    let plain = AdaptiveLogSoftmaxWithLoss::with_config(8, 10, &[3, 6], half, &dev)?;
    check("adaptive_log_softmax_log_prob", &plain, &["input"], |t| {
        plain.log_prob(&t[0])
    });
    // `check` moved the module to the device under test.
    let dev = crate::nn_fixture::device();
    let x = Tensor::randn(0f32, 1., (5, 8), &dev)?;
    let best = plain.log_prob(&x)?.argmax(1)?;
    assert_eq!(plain.predict(&x)?.to_vec1::<u32>()?, best.to_vec1::<u32>()?);
    assert!(AdaptiveLogSoftmaxWithLoss::new(8, 10, &[6, 3], &dev).is_err());
    let err = plain
        .call((&x, &Tensor::new(&[0i64, 1, 2, 3, 10], &dev)?))
        .unwrap_err();
    assert!(err.to_string().contains("[0, 10)"), "{err}");
    Ok(())
}

#[test]
fn weights_are_buffers_under_pytorch_names() -> Result<()> {
    let loss = BCEWithLogitsLoss::with_config(five(), five(), LossReduction::Mean);
    let names: Vec<String> = loss.named_buffers().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["weight", "pos_weight"]);
    assert!(loss.named_parameters().is_empty());
    let ce = CrossEntropyLoss::with_config(
        ClassLossConfig {
            weight: five(),
            ..Default::default()
        },
        &Device::Cpu,
    )?;
    assert_eq!(ce.state_dict()?.keys().collect::<Vec<_>>(), ["weight"]);
    Ok(())
}

#[test]
fn bad_inputs_are_typed_errors_naming_the_shapes() -> Result<()> {
    let dev = Device::Cpu;
    let logits = Tensor::zeros((4, 5), DType::F32, &dev)?;
    let err = CrossEntropyLoss::new()
        .call((&logits, &Tensor::zeros(3, DType::I64, &dev)?))
        .unwrap_err();
    assert!(
        matches!(
            err.inner(),
            Error::InputShape {
                layer: "CrossEntropyLoss",
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("[4]") && err.to_string().contains("[3]"),
        "{err}"
    );
    // Class ids as floats of the wrong shape are not probabilities either.
    let err = CrossEntropyLoss::new()
        .call((&logits, &Tensor::zeros(4, DType::F32, &dev)?))
        .unwrap_err();
    assert!(err.to_string().contains("[4, 5]"), "{err}");
    // Class weights of another length than the classes.
    let three = Some(Tensor::ones(3, DType::F32, &dev)?);
    let weighted = NLLLoss::with_config(
        ClassLossConfig {
            weight: three,
            ..Default::default()
        },
        &dev,
    )?;
    let err = weighted
        .call((&logits, &Tensor::zeros(4, DType::I64, &dev)?))
        .unwrap_err();
    assert!(err.to_string().contains("[3]"), "{err}");
    let smoothing = ClassLossConfig {
        label_smoothing: 0.1,
        ..Default::default()
    };
    assert!(matches!(
        NLLLoss::with_config(smoothing, &dev),
        Err(Error::InvalidConfig { .. })
    ));

    let other = Tensor::zeros((4, 6), DType::F32, &dev)?;
    let err = MSELoss::new().call((&logits, &other)).unwrap_err();
    assert!(
        err.to_string().contains("[4, 5]") && err.to_string().contains("[4, 6]"),
        "{err}"
    );
    assert!(BCEWithLogitsLoss::new().call((&logits, &other)).is_err());
    assert!(CosineSimilarity::new().call((&logits, &other)).is_err());
    assert!(PairwiseDistance::new().call((&logits, &other)).is_err());
    let targets = Tensor::ones(3, DType::F32, &dev)?;
    let err = CosineEmbeddingLoss::new()
        .call((&logits, &logits, &targets))
        .unwrap_err();
    assert!(err.to_string().contains("[3]"), "{err}");
    assert!(TripletMarginLoss::new()
        .call((&logits, &logits, &other))
        .is_err());
    assert!(MarginRankingLoss::new()
        .call((&logits, &logits, &other))
        .is_err());
    Ok(())
}

/// `LinearCrossEntropyLoss` with class ids and the mean takes the logits by blocks of the classes
/// (5000: two blocks of the kernels' 4096), with the loss and the gradients of the input and of
/// the layer's weight those of the logits made whole (`without_fusion`), ignored ids included.
#[test]
fn linear_cross_entropy_loss_by_blocks_matches_the_whole_logits() -> Result<()> {
    use module_runtime::nn::without_fusion;
    let dev = Device::Cpu;
    let config = LinearCrossEntropyConfig {
        ignore_index: Some(-100),
        ..Default::default()
    };
    let head = LinearCrossEntropyLoss::with_config(16, 5000, config, &dev)?;
    let x = candle_core::Var::from_tensor(&Tensor::randn(0f32, 1., (3, 7, 16), &dev)?)?;
    let ids: Vec<i64> = (0..21)
        .map(|i| if i % 4 == 1 { -100 } else { i * 613 % 5000 })
        .collect();
    let target = Tensor::from_vec(ids, (3, 7), &dev)?;
    let run = || -> Result<(Tensor, Tensor, Tensor)> {
        let loss = head.call((x.as_tensor(), &target))?;
        let grads = loss.backward()?;
        let w = head.linear.weight.var()?;
        let dx = grads.get(&x).expect("the input's gradient").clone();
        let dw = grads
            .get(w.as_tensor())
            .expect("the weight's gradient")
            .clone();
        Ok((loss, dx, dw))
    };
    let (loss, dx, dw) = run()?;
    let (whole, wdx, wdw) = without_fusion(run)?;
    let diff = |a: &Tensor, b: &Tensor| -> Result<f32> {
        Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
    };
    assert!(diff(&loss, &whole)? < 2e-6, "loss");
    assert!(diff(&dx, &wdx)? < 1e-5, "input gradient");
    assert!(diff(&dw, &wdw)? < 1e-5, "weight gradient");
    Ok(())
}
