//! `gradient_checkpointing_enable()` on the derived BERT: every encoder layer's activations are
//! dropped after its forward and recomputed in the backward, and the gradients are those of the
//! plain model bit for bit. A small random model in training mode with its dropout probabilities
//! at 0, so no test of this binary running at the same time can move the random generator under
//! it (bit-identity with dropout drawing is tested in `tests/reproducible`).

use minilm::bert::{BertConfig, BertModel};
use module_runtime::prelude::*;

/// Each parameter's gradient (none for the pooler's, which `call` does not run), by path.
type Gradients = Vec<(String, Option<Vec<f32>>)>;

#[test]
fn checkpointed_layers_give_the_plain_gradients_bit_for_bit() -> Result<()> {
    let dev = Device::Cpu;
    let cfg = BertConfig {
        vocab_size: 60,
        hidden_size: 64,
        num_hidden_layers: 3,
        num_attention_heads: 4,
        intermediate_size: 256,
        max_position_embeddings: 32,
        hidden_dropout_prob: 0.0,
        attention_probs_dropout_prob: 0.0,
        ..BertConfig::minilm_l6()
    };
    let model = BertModel::new(&cfg, &dev)?;
    model.train();
    let (batch, seq) = (4, 12);
    let (ids, mask) = super::padded_batch(batch, seq, &dev)?;
    let upstream = Tensor::randn(0f32, 1., (batch, seq, cfg.hidden_size), &dev)?;
    // The gradients, and how many values the graph's intermediate tensors hold (leaves aside).
    let run = || -> Result<(Gradients, usize)> {
        let hidden = model.call((&ids, &mask))?;
        let nodes = hidden
            .sorted_nodes()
            .iter()
            .filter(|n| !n.is_variable())
            .map(|n| n.elem_count())
            .sum();
        let grads = (hidden * &upstream)?.sum_all()?.backward()?;
        let grads = model
            .named_parameters()
            .into_iter()
            .map(|(name, p)| {
                let g = grads.get(&p.tensor()?).map(|g| g.flatten_all()?.to_vec1());
                Ok((name, g.transpose()?))
            })
            .collect::<Result<_>>()?;
        Ok((grads, nodes))
    };
    let (plain, plain_nodes) = run()?;
    model.gradient_checkpointing_enable();
    let (checkpointed, checkpointed_nodes) = run()?;
    assert_eq!(checkpointed, plain);
    assert!(plain.iter().filter(|(_, g)| g.is_some()).count() > 30);
    // The layers' insides are not in the graph: each layer's output and a few scalars are.
    assert!(
        checkpointed_nodes * 4 < plain_nodes,
        "{checkpointed_nodes} values in the checkpointed graph, {plain_nodes} in the plain one"
    );
    // Disabled again, the layers run plainly.
    model.gradient_checkpointing_disable();
    assert_eq!(run()?.1, plain_nodes);
    Ok(())
}
