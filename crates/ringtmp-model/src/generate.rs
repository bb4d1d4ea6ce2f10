//! Generating tokens from a language model: the prompt encoded in one step, then one sampled
//! token at a time, over a [`Chain`] — the model's stages in one process ([`LocalChain`]) or
//! spread over nodes that each keep the KV cache of their own layers.
//!
//! Sampling is nanoGPT's and `transformers`': the last position's logits over the temperature,
//! only the `top_k` largest kept, then only the most likely of those whose probabilities sum
//! to `top_p` (nucleus sampling), a draw from their softmax by a generator seeded from `seed`
//! (ChaCha8), so the same model, prompt and seed give the same tokens wherever the stages run.
//! A temperature of 0 takes the most likely token. Generation ends early at a stop token (a
//! pretrained model's end of sequence or of turn), which is not handed on.
//!
//! The context: a prompt longer than the model's context keeps its last `context` tokens (as
//! nanoGPT crops). When the sequence fills the context, the chain forgets it and encodes the
//! last half of the context again (one prefill per `context / 2` tokens) rather than recompute
//! every position for every token: positions are absolute (learned position embeddings), so a
//! cache cannot slide.
//!
//! Invariants: exactly `count` tokens are produced, each handed to `on_token` as soon as it is
//! drawn; a chain never holds more than its capacity of positions.

use std::time::Instant;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::decode::Decoder;
use crate::error::{Error, Result};
use crate::packed::DecodeStage;
use crate::stage::Stage;

/// A language model's stages, wherever they run, decoding one sequence.
pub trait Chain {
    /// What can go wrong: the engine's errors, and the links' where the stages are remote.
    type Error: From<Error>;
    /// Runs the new positions `ids` of the sequence through every stage; returns the logits of
    /// the last of them (`[vocab]`).
    fn feed(&mut self, ids: &[u32]) -> std::result::Result<Vec<f32>, Self::Error>;
    /// Forgets the sequence (every stage's cache).
    fn reset(&mut self) -> std::result::Result<(), Self::Error>;
    /// Positions decoded so far.
    fn position(&self) -> usize;
    /// The most positions a sequence may have.
    fn capacity(&self) -> usize;
}

/// A model's stages in this process (training stages, or [`crate::packed::InferenceStage`]s
/// holding packed weights), each with its decoder.
pub struct LocalChain<S: DecodeStage = Stage> {
    stages: Vec<(S, Decoder)>,
}

impl<S: DecodeStage> LocalChain<S> {
    /// The chain of `stages`, in order (the first reads token ids, the last gives logits).
    pub fn new(stages: Vec<S>) -> Result<Self> {
        let count = stages.len();
        let stages = stages
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                let d = Decoder::new(&s)?;
                Ok((
                    s,
                    if i + 1 == count {
                        d.last_position_only()
                    } else {
                        d
                    },
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        if stages.is_empty() {
            return Err(Error::Config {
                source_name: "generation".into(),
                reason: "no stages".into(),
            });
        }
        Ok(Self { stages })
    }

    /// Bytes every stage's cache holds now.
    pub fn cache_bytes(&self) -> usize {
        self.stages.iter().map(|(_, d)| d.cache_bytes()).sum()
    }
}

impl<S: DecodeStage> Chain for LocalChain<S> {
    type Error = Error;

    fn feed(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        let mut x: Vec<f32> = ids.iter().map(|&t| t as f32).collect();
        for (stage, decoder) in &mut self.stages {
            x = decoder.step(stage, &x, ids.len())?.to_vec();
        }
        // The last stage's decoder gives the last position's logits alone.
        Ok(x)
    }

    fn reset(&mut self) -> Result<()> {
        for (_, decoder) in &mut self.stages {
            decoder.reset();
        }
        Ok(())
    }

    fn position(&self) -> usize {
        self.stages[0].1.position()
    }

    fn capacity(&self) -> usize {
        self.stages
            .iter()
            .map(|(_, d)| d.capacity())
            .min()
            .unwrap_or(0)
    }
}

/// How tokens are drawn.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    /// Divides the logits; 0 takes the most likely token.
    pub temperature: f32,
    /// Only the `top_k` most likely tokens may be drawn; 0 = all.
    pub top_k: usize,
    /// Only the most likely tokens whose probabilities sum to `top_p` may be drawn; 1 = all.
    pub top_p: f32,
    /// Seeds the draws.
    pub seed: u64,
    /// Tokens that end the generation.
    pub stop: Vec<u32>,
}

impl Sampling {
    /// Temperature and top-k sampling (no nucleus, no stop token), as nanoGPT samples.
    pub fn top_k(temperature: f32, top_k: usize, seed: u64) -> Self {
        Self {
            temperature,
            top_k,
            top_p: 1.0,
            seed,
            stop: Vec::new(),
        }
    }
}

/// Draws a token from `logits` as `sampling` says, with `rng`.
pub fn sample(logits: &[f32], sampling: &Sampling, rng: &mut ChaCha8Rng) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |best, (i, &x)| {
                if x > best.1 { (i, x) } else { best }
            })
            .0 as u32
    };
    if sampling.temperature <= 0.0 {
        return argmax();
    }
    let t = f64::from(sampling.temperature);
    // The k-th largest logit: those below it are out.
    let floor = if sampling.top_k > 0 && sampling.top_k < logits.len() {
        let mut sorted = logits.to_vec();
        sorted.sort_unstable_by(|a, b| b.total_cmp(a));
        sorted[sampling.top_k - 1]
    } else {
        f32::NEG_INFINITY
    };
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut weights: Vec<f64> = logits
        .iter()
        .map(|&x| {
            if x < floor {
                0.0
            } else {
                ((f64::from(x) - f64::from(max)) / t).exp()
            }
        })
        .collect();
    let mut total: f64 = weights.iter().sum();
    if !(total.is_finite() && total > 0.0) {
        return argmax();
    }
    if sampling.top_p < 1.0 {
        total = nucleus(&mut weights, total, f64::from(sampling.top_p));
    }
    let mut u = rng.random::<f64>() * total;
    for (i, w) in weights.iter().enumerate() {
        if u < *w {
            return i as u32;
        }
        u -= w;
    }
    // Rounding left `u` past the last weight: the last token that could be drawn.
    weights.iter().rposition(|w| *w > 0.0).unwrap_or(0) as u32
}

/// Keeps the largest `weights` whose sum reaches `top_p` of `total` (at least one), zeroing the
/// rest; returns the sum kept.
fn nucleus(weights: &mut [f64], total: f64, top_p: f64) -> f64 {
    let mut order: Vec<usize> = (0..weights.len()).filter(|&i| weights[i] > 0.0).collect();
    order.sort_unstable_by(|&a, &b| weights[b].total_cmp(&weights[a]));
    let (mut kept, mut count) = (0.0, 0);
    for &i in &order {
        kept += weights[i];
        count += 1;
        if kept >= top_p * total {
            break;
        }
    }
    for &i in &order[count..] {
        weights[i] = 0.0;
    }
    kept
}

/// What a generation produced and how long it took.
#[derive(Clone, Debug, PartialEq)]
pub struct Generated {
    /// The tokens drawn, in order (the prompt not included).
    pub tokens: Vec<u32>,
    /// Seconds from the start to the first token drawn (the prompt's encoding).
    pub first_token_seconds: f64,
    /// Seconds in all.
    pub seconds: f64,
    /// Times the context filled and its last half was encoded again.
    pub refills: u32,
    /// The stop token that ended it, if one did.
    pub stopped_at: Option<u32>,
}

impl Generated {
    /// Tokens per second after the first (the decoding rate).
    pub fn tokens_per_second(&self) -> f64 {
        let after = self.tokens.len().saturating_sub(1) as f64;
        after / (self.seconds - self.first_token_seconds).max(1e-9)
    }
}

/// Draws `count` tokens after `prompt` from `chain`, handing each to `on_token` as it comes.
pub fn generate<C: Chain + ?Sized>(
    chain: &mut C,
    prompt: &[u32],
    count: usize,
    sampling: &Sampling,
    on_token: &mut dyn FnMut(u32) -> std::result::Result<(), C::Error>,
) -> std::result::Result<Generated, C::Error> {
    let capacity = chain.capacity();
    if prompt.is_empty() || capacity == 0 {
        return Err(Error::Config {
            source_name: "generation".into(),
            reason: "an empty prompt (at least one token is needed to start from)".into(),
        }
        .into());
    }
    let started = Instant::now();
    let mut rng = ChaCha8Rng::seed_from_u64(sampling.seed);
    let mut sequence = prompt.to_vec();
    let mut tokens = Vec::with_capacity(count);
    let (mut first_token_seconds, mut refills, mut stopped_at) = (0.0, 0, None);
    chain.reset()?;
    let mut logits = chain.feed(&prompt[prompt.len().saturating_sub(capacity)..])?;
    for i in 0..count {
        let token = sample(&logits, sampling, &mut rng);
        if i == 0 {
            first_token_seconds = started.elapsed().as_secs_f64();
        }
        if sampling.stop.contains(&token) {
            stopped_at = Some(token);
            break;
        }
        sequence.push(token);
        tokens.push(token);
        on_token(token)?;
        if i + 1 == count {
            break;
        }
        logits = if chain.position() < capacity {
            chain.feed(&[token])?
        } else {
            refills += 1;
            chain.reset()?;
            let keep = (capacity / 2).max(1);
            chain.feed(&sequence[sequence.len() - keep..])?
        };
    }
    Ok(Generated {
        tokens,
        first_token_seconds,
        seconds: started.elapsed().as_secs_f64(),
        refills,
        stopped_at,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_follows_temperature_and_top_k() {
        let logits = [1.0f32, 3.0, 2.0, -1.0];
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let greedy = Sampling::top_k(0.0, 0, 1);
        assert_eq!(sample(&logits, &greedy, &mut rng), 1);
        // Top 2: only tokens 1 and 2 are ever drawn, 1 more often (e^1 : 1).
        let top2 = Sampling::top_k(1.0, 2, 1);
        let mut counts = [0u32; 4];
        for _ in 0..10_000 {
            counts[sample(&logits, &top2, &mut rng) as usize] += 1;
        }
        assert_eq!((counts[0], counts[3]), (0, 0), "{counts:?}");
        let ratio = f64::from(counts[1]) / f64::from(counts[2]);
        assert!((ratio - 1f64.exp()).abs() < 0.25, "{counts:?}");
        // Top p 0.6 of e³, e², e¹, e⁻¹ (0.66, 0.24, ...): only the most likely is left.
        let nucleus = Sampling {
            top_p: 0.6,
            ..Sampling::top_k(1.0, 0, 1)
        };
        assert!((0..200).all(|_| sample(&logits, &nucleus, &mut rng) == 1));
        // Top p 0.8: the two most likely (0.66 + 0.24 ≥ 0.8), in their ratio.
        let nucleus = Sampling {
            top_p: 0.8,
            ..Sampling::top_k(1.0, 0, 1)
        };
        let mut counts = [0u32; 4];
        for _ in 0..10_000 {
            counts[sample(&logits, &nucleus, &mut rng) as usize] += 1;
        }
        assert_eq!((counts[0], counts[3]), (0, 0), "{counts:?}");
        // A high temperature flattens the distribution: every token is drawn.
        let hot = Sampling::top_k(100.0, 0, 1);
        let mut seen = [false; 4];
        for _ in 0..1000 {
            seen[sample(&logits, &hot, &mut rng) as usize] = true;
        }
        assert!(seen.iter().all(|s| *s));
    }

    /// A chain whose logits favour the token after the last one fed, counting what it was fed.
    struct Counter {
        position: usize,
        capacity: usize,
        fed: Vec<usize>,
    }

    impl Chain for Counter {
        type Error = Error;

        fn feed(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
            self.position += ids.len();
            assert!(self.position <= self.capacity);
            self.fed.push(ids.len());
            let mut logits = vec![0.0; 10];
            logits[(*ids.last().unwrap() as usize + 1) % 10] = 5.0;
            Ok(logits)
        }
        fn reset(&mut self) -> Result<()> {
            self.position = 0;
            Ok(())
        }
        fn position(&self) -> usize {
            self.position
        }
        fn capacity(&self) -> usize {
            self.capacity
        }
    }

    #[test]
    fn a_split_model_draws_the_same_tokens_as_the_whole() {
        let layers = crate::decode::tests::gpt(12);
        let whole = Stage::new(&layers, 0..layers.len(), 9, 2);
        let parts = vec![
            Stage::new(&layers, 0..2, 9, 2),
            Stage::new(&layers, 2..4, 9, 2),
            Stage::new(&layers, 4..layers.len(), 9, 2),
        ];
        let sampling = Sampling::top_k(1.0, 5, 42);
        let draw = |chain: &mut LocalChain| {
            generate(chain, &[1, 2, 3], 30, &sampling, &mut |_| Ok(()))
                .unwrap()
                .tokens
        };
        let one = draw(&mut LocalChain::new(vec![whole]).unwrap());
        let mut split = LocalChain::new(parts).unwrap();
        assert_eq!(draw(&mut split), one);
        // 30 tokens after 3 in a context of 12: refilled, and the cache within the context.
        assert!(split.cache_bytes() <= 2 * 12 * 16 * 4 * 2);
    }

    #[test]
    fn a_full_context_is_encoded_again_from_its_last_half() {
        let mut chain = Counter {
            position: 0,
            capacity: 8,
            fed: Vec::new(),
        };
        let greedy = Sampling::top_k(0.0, 0, 0);
        let mut streamed = Vec::new();
        let prompt: Vec<u32> = (0..10).collect();
        let out = generate(&mut chain, &prompt, 12, &greedy, &mut |t| {
            streamed.push(t);
            Ok(())
        })
        .unwrap();
        assert_eq!(out.tokens, streamed);
        assert_eq!(out.tokens, vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]);
        // The prompt's last 8, then one at a time; full at 8: the last 4 again, then on.
        assert_eq!(chain.fed, vec![8, 4, 1, 1, 1, 1, 4, 1, 1, 1, 1, 4]);
        assert_eq!(out.refills, 3);
        assert!(generate(&mut chain, &[], 3, &greedy, &mut |_| Ok(())).is_err());
    }
}
