//! The RAG family: document chunks drawn by Zipf popularity, then a question.

use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::request::{GenParams, WorkloadError, WorkloadRequest};
use super::synth::{check_range, positive, push_text, tokens_in, Arrivals, Weighted, FAMILY_RAG};

/// Retrieval-augmented generation: a shared instruction prompt, then `chunks_per_prompt`
/// distinct chunks drawn from `documents` by Zipf popularity (exponent `zipf_s`, most popular
/// first, as a retriever ranks them), then a unique question.
#[derive(Clone, Debug)]
pub struct RagParams {
    /// Corpus size (one chunk per document). Default 500.
    pub documents: usize,
    /// Zipf exponent of document popularity. Default 1.1.
    pub zipf_s: f64,
    /// Chunks in each prompt (k). Default 4.
    pub chunks_per_prompt: usize,
    /// Chunk length. Default 512 tokens.
    pub chunk_tokens: u32,
    /// Instruction prompt shared by every request. Default 256 tokens.
    pub system_tokens: u32,
    /// Question length range. Default 32..=128 tokens.
    pub question_tokens: (u32, u32),
    /// Output length range. Default 64..=256 tokens.
    pub output_tokens: (u32, u32),
}

impl Default for RagParams {
    fn default() -> Self {
        RagParams {
            documents: 500,
            zipf_s: 1.1,
            chunks_per_prompt: 4,
            chunk_tokens: 512,
            system_tokens: 256,
            question_tokens: (32, 128),
            output_tokens: (64, 256),
        }
    }
}

/// Generates [`RagParams`] requests.
pub fn rag(p: &RagParams, gen: &GenParams) -> Result<Vec<WorkloadRequest>, WorkloadError> {
    gen.validate()?;
    positive("documents", p.documents)?;
    positive("chunks_per_prompt", p.chunks_per_prompt)?;
    if p.chunks_per_prompt > p.documents {
        return Err(WorkloadError::Invalid(
            "chunks_per_prompt must not exceed documents".into(),
        ));
    }
    if !(p.zipf_s.is_finite() && p.zipf_s >= 0.0) {
        return Err(WorkloadError::Invalid("zipf_s must be >= 0".into()));
    }
    check_range("question_tokens", p.question_tokens)?;
    check_range("output_tokens", p.output_tokens)?;
    let popularity = Weighted::zipf(p.documents, p.zipf_s);
    let mut rng = SmallRng::seed_from_u64(gen.seed);
    let mut arrivals = Arrivals {
        t: 0.0,
        rate: gen.rate,
    };
    let mut out = Vec::with_capacity(gen.requests);
    let mut chosen = Vec::with_capacity(p.chunks_per_prompt);
    for i in 0..gen.requests {
        chosen.clear();
        while chosen.len() < p.chunks_per_prompt {
            let d = popularity.draw(&mut rng);
            if !chosen.contains(&d) {
                chosen.push(d);
            }
        }
        chosen.sort_unstable();
        let mut segments = Vec::new();
        push_text(&mut segments, FAMILY_RAG, u64::MAX, 0, p.system_tokens);
        for &d in &chosen {
            push_text(&mut segments, FAMILY_RAG, d as u64, 0, p.chunk_tokens);
        }
        let q = tokens_in(&mut rng, p.question_tokens);
        push_text(&mut segments, FAMILY_RAG, u64::MAX - 1, i as u64, q);
        out.push(WorkloadRequest {
            at_s: arrivals.next(&mut rng),
            segments,
            output_tokens: tokens_in(&mut rng, p.output_tokens),
            session: None,
            // What a RAG application knows and sends: the document its prompt leads with.
            affinity: chosen.first().map(|d| format!("doc-{d}")),
            tenant: None,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::workload::testing::*;

    #[test]
    fn rag_documents_follow_zipf_popularity() {
        let p = RagParams::default();
        let reqs = rag(&p, &gen(2000)).unwrap();
        let mut counts: HashMap<u64, usize> = HashMap::new();
        for r in &reqs {
            assert_eq!(r.segments.len(), 1 + p.chunks_per_prompt + 1);
            let chunks: HashSet<_> = r.segments[1..=p.chunks_per_prompt].iter().collect();
            assert_eq!(chunks.len(), p.chunks_per_prompt, "chunks are distinct");
            for &(id, _) in &r.segments[1..=p.chunks_per_prompt] {
                *counts.entry(id).or_default() += 1;
            }
        }
        let mut by_pop: Vec<usize> = counts.values().copied().collect();
        by_pop.sort_unstable_by(|a, b| b.cmp(a));
        // The most popular document is in nearly every prompt; the tail is long.
        assert!(by_pop[0] > 900, "{by_pop:?}");
        assert!(by_pop[0] > 10 * by_pop[by_pop.len() / 2]);
        assert!(counts.len() > 100);
    }
}
