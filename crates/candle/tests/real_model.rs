//! Checks on the real SmolLM2-135M-Instruct (`cargo xtask eval --check` runs them: it fetches
//! the model, sets `KVQ_MODEL` and `CANDLE_DEQUANTIZE_ALL=1`). Ignored in `cargo test`: no test
//! there needs the downloaded model.
//!
//! - Logits equal candle-transformers' `quantized_llama` to 1e-4 relative at every position of
//!   a 32-token prefill and 32 decode steps on the shared tokens.
//! - The keys and attention outputs of layers 0, 9 and 29 equal those that Hugging Face
//!   transformers computed for `../shared/data/kv-smollm2-135m-sample.safetensors` (a second
//!   implementation nobody here wrote), and so does the perplexity it recorded.
//! - The GGUF's tokenizer gives the capture's 2048 token ids from the text of *Botchan*
//!   (`KVQ_TEXT`, default `target/texts/botchan.txt`, from `cargo xtask fetch-text botchan`).

mod common;

use std::path::PathBuf;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use common::rel_diff;
use kvq::quant::io::TensorFile;
use kvq_candle::{F32Cache, GgufTokenizer, KvStore, LlamaModel, Weights};

fn model_path() -> PathBuf {
    PathBuf::from(std::env::var("KVQ_MODEL").expect("KVQ_MODEL: run `cargo xtask eval --check`"))
}

#[path = "../../quant-core/tests/common/shared_data.rs"]
mod shared_data;

/// The shared capture: these checks compare against its transformers outputs and cannot fall
/// back to the embedded sample, which has none.
fn shared() -> PathBuf {
    shared_data::shared_capture().expect("the shared capture (../shared/data or KVQ_SHARED_DATA)")
}

fn shared_tokens() -> Vec<u32> {
    let bytes = std::fs::read(shared()).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("input_ids").unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::I32);
    t.data().chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().unwrap()) as u32).collect()
}

#[test]
#[ignore = "needs the real model: cargo xtask eval --check"]
fn logits_equal_candle_transformers_on_the_real_model() {
    assert_eq!(
        std::env::var("CANDLE_DEQUANTIZE_ALL").as_deref(),
        Ok("1"),
        "run through cargo xtask eval --check"
    );
    let path = model_path();
    let tokens = &shared_tokens()[..64];
    let mut f = std::fs::File::open(&path).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let mut theirs = ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap();
    let model = LlamaModel::load(&path).unwrap();
    let mut cache = model.f32_cache().unwrap();
    let mut ours: Vec<Vec<f32>> = model.forward(&mut cache, &tokens[..32]).unwrap().to_vec2().unwrap();
    for &t in &tokens[32..] {
        ours.push(model.forward(&mut cache, &[t]).unwrap().squeeze(0).unwrap().to_vec1().unwrap());
    }
    let mut worst = 0f32;
    for (i, &t) in tokens.iter().enumerate() {
        let x = Tensor::new(&[[t]], &Device::Cpu).unwrap();
        let row = theirs.forward(&x, i).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let d = rel_diff(&ours[i], &row);
        assert!(d <= 1e-4, "position {i}: relative difference {d}");
        worst = worst.max(d);
    }
    eprintln!(
        "real model vs candle-transformers: worst relative logit difference {worst:.2e} over 64 positions"
    );
}

/// The f32 cache, recording the keys of some layers and their attention outputs from position
/// `from` on (`attention` takes `&self`, hence the cell).
struct Recording {
    inner: F32Cache,
    layers: [usize; 3],
    keys: Vec<Vec<f32>>,
    attn: std::cell::RefCell<Vec<Vec<f32>>>,
    from: usize,
}

impl KvStore for Recording {
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> kvq_candle::Result<()> {
        if let Some(i) = self.layers.iter().position(|&l| l == layer) {
            self.keys[i].extend_from_slice(k);
        }
        self.inner.append(layer, k, v)
    }
    fn attention(&self, layer: usize, q: &[f32], out: &mut [f32]) -> kvq_candle::Result<()> {
        self.inner.attention(layer, q, out)?;
        if self.inner.len(layer) > self.from
            && let Some(i) = self.layers.iter().position(|&l| l == layer)
        {
            self.attn.borrow_mut()[i].extend_from_slice(out);
        }
        Ok(())
    }
    fn len(&self, layer: usize) -> usize {
        self.inner.len(layer)
    }
    fn truncate(&mut self, len: usize) -> kvq_candle::Result<()> {
        self.inner.truncate(len)
    }
    fn reset(&mut self) -> kvq_candle::Result<()> {
        self.inner.reset()
    }
    fn used_bytes(&self) -> usize {
        self.inner.used_bytes()
    }
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
#[ignore = "needs the real model: cargo xtask eval --check"]
fn keys_attention_and_perplexity_equal_the_transformers_capture() {
    let model = LlamaModel::load_with(model_path(), Weights::F32).unwrap();
    let c = model.config().clone();
    let tokens = shared_tokens();
    let n = tokens.len();
    let layers = [0, 9, 29];
    let mut rec = Recording {
        inner: model.f32_cache().unwrap(),
        layers,
        keys: vec![Vec::new(); 3],
        attn: std::cell::RefCell::new(vec![Vec::new(); 3]),
        from: n - 64,
    };
    let logits: Vec<Vec<f32>> = model.forward(&mut rec, &tokens).unwrap().to_vec2().unwrap();
    let attn = rec.attn.into_inner();
    let file = TensorFile::open(shared()).unwrap();
    let (h, d) = (c.kv_heads, c.head_dim);
    for (i, &l) in layers.iter().enumerate() {
        // The capture's keys are [head, token, channel] in Hugging Face's rotate-half layout;
        // the GGUF's weights are permuted so that its pair i, (i, i + d/2), is our (2i, 2i + 1).
        let theirs = file.read(&format!("layer{l}.k")).unwrap();
        let mut ours = vec![0f32; h * n * d];
        for t in 0..n {
            for head in 0..h {
                for j in 0..d / 2 {
                    let src = &rec.keys[i][(t * h + head) * d..];
                    ours[(head * n + t) * d + j] = src[2 * j];
                    ours[(head * n + t) * d + j + d / 2] = src[2 * j + 1];
                }
            }
        }
        let ek = rel_l2(&ours, theirs.data());
        // Attention outputs of the last 64 positions, [head, position, channel] there.
        let theirs = file.read(&format!("layer{l}.attn_out")).unwrap();
        let mut ours = vec![0f32; c.heads * 64 * d];
        for p in 0..64 {
            for head in 0..c.heads {
                ours[(head * 64 + p) * d..][..d].copy_from_slice(&attn[i][(p * c.heads + head) * d..][..d]);
            }
        }
        let ea = rel_l2(&ours, theirs.data());
        eprintln!(
            "layer {l}: keys relative L2 error {ek:.2e} (their keys are f16), attention outputs {ea:.2e}"
        );
        assert!(ek < 2e-3, "layer {l} keys: {ek}");
        assert!(ea < 1e-3, "layer {l} attention: {ea}");
    }
    let nll: f64 = (0..n - 1)
        .map(|p| {
            let row = &logits[p];
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
                - row[tokens[p + 1] as usize] as f64
        })
        .sum();
    let ppl = (nll / (n - 1) as f64).exp();
    eprintln!("perplexity over the 2048 tokens: {ppl:.4} (the capture recorded 28.595)");
    assert!((ppl / 28.595 - 1.0).abs() < 1e-3, "{ppl}");
}

#[test]
#[ignore = "needs the real model and the text: cargo xtask eval --check"]
fn the_gguf_tokenizer_gives_the_captured_tokens() {
    let text_path = std::env::var("KVQ_TEXT")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/texts/botchan.txt"));
    // The file has CRLF line ends; the capture read it in Python's text mode, which turns
    // them into LF. (kvq-eval, like llama-perplexity, tokenizes a file's bytes as they are.)
    let text = std::fs::read_to_string(&text_path).unwrap().replace("\r\n", "\n");
    let start = text.find("CHAPTER I").expect("the capture starts at 'CHAPTER I'");
    let tok = GgufTokenizer::load(model_path()).unwrap();
    let ids = tok.encode(&text[start..]).unwrap();
    let want = shared_tokens();
    // The capture added no BOS token; neither does this model's tokenizer.
    let matching = ids.iter().zip(&want).take_while(|(a, b)| a == b).count();
    assert_eq!(
        matching,
        want.len(),
        "the first {matching} of {} ids agree; then ours {:?} theirs {:?}",
        want.len(),
        &ids[matching..(matching + 5).min(ids.len())],
        &want[matching..(matching + 5).min(want.len())]
    );
    eprintln!(
        "tokenizer: {} tokens from 'CHAPTER I' on, the first {} equal the capture's",
        ids.len(),
        want.len()
    );
}
