//! A small multi-layer perceptron with hand-written forward and backward passes, for
//! the data-parallel example and tests: no framework, `f32` throughout, ReLU hidden
//! layers and a softmax cross-entropy loss. Backward reports each gradient the moment
//! it is final (last layer first), which is where a [`Reducer`](super::Reducer) starts
//! bucket all-reduces while the rest of backward runs.

use rand::{Rng, SeedableRng};

use super::Parameters;

/// Layer widths, weights and biases, their gradients, and the last forward pass's
/// activations.
#[derive(Clone, Debug)]
pub struct Mlp {
    widths: Vec<usize>,
    /// `[layer]`: weights (`in × out`, row-major) then biases, in registration order
    /// `w0, b0, w1, b1, …`.
    params: Vec<Vec<f32>>,
    grads: Vec<Vec<f32>>,
    /// `[layer]`: inputs to each layer (after ReLU), then the output probabilities.
    acts: Vec<Vec<f32>>,
    batch: usize,
}

impl Mlp {
    /// A network with the given widths (`[64, 128, 10]`: 64 inputs, one hidden layer
    /// of 128, 10 classes), weights drawn from `seed` (He initialisation).
    pub fn new(widths: &[usize], seed: u64) -> Self {
        assert!(widths.len() >= 2, "an MLP has an input and an output width");
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut params = Vec::new();
        for w in widths.windows(2) {
            let scale = (2.0 / w[0] as f32).sqrt();
            params.push(
                (0..w[0] * w[1])
                    .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale)
                    .collect(),
            );
            params.push(vec![0.0; w[1]]);
        }
        let grads = params.iter().map(|p| vec![0.0; p.len()]).collect();
        Mlp {
            widths: widths.to_vec(),
            params,
            grads,
            acts: Vec::new(),
            batch: 0,
        }
    }

    /// The length of every parameter, in registration order.
    pub fn lengths(&self) -> Vec<usize> {
        self.params.iter().map(Vec::len).collect()
    }

    /// Runs `x` (`batch × inputs`, row-major) through the network; returns the class
    /// probabilities (`batch × classes`).
    pub fn forward(&mut self, x: &[f32], batch: usize) -> &[f32] {
        assert_eq!(x.len(), batch * self.widths[0], "input size");
        self.batch = batch;
        self.acts.clear();
        self.acts.push(x.to_vec());
        let layers = self.widths.len() - 1;
        for l in 0..layers {
            let (n_in, n_out) = (self.widths[l], self.widths[l + 1]);
            let (w, b) = (&self.params[2 * l], &self.params[2 * l + 1]);
            let input = &self.acts[l];
            let mut out = vec![0.0f32; batch * n_out];
            for s in 0..batch {
                let row = &mut out[s * n_out..(s + 1) * n_out];
                row.copy_from_slice(b);
                for i in 0..n_in {
                    let a = input[s * n_in + i];
                    if a != 0.0 {
                        for (o, wv) in row.iter_mut().zip(&w[i * n_out..(i + 1) * n_out]) {
                            *o += a * wv;
                        }
                    }
                }
                if l + 1 < layers {
                    row.iter_mut().for_each(|v| *v = v.max(0.0));
                } else {
                    let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0.0;
                    row.iter_mut().for_each(|v| {
                        *v = (*v - m).exp();
                        sum += *v;
                    });
                    row.iter_mut().for_each(|v| *v /= sum);
                }
            }
            self.acts.push(out);
        }
        self.acts.last().expect("an output")
    }

    /// Mean cross-entropy of the last forward pass against `labels`.
    pub fn loss(&self, labels: &[usize]) -> f32 {
        let probs = self.acts.last().expect("forward first");
        let classes = *self.widths.last().expect("widths");
        labels
            .iter()
            .enumerate()
            .map(|(s, &y)| -probs[s * classes + y].max(1e-12).ln())
            .sum::<f32>()
            / labels.len() as f32
    }

    /// Number of correct predictions of the last forward pass.
    pub fn correct(&self, labels: &[usize]) -> usize {
        let probs = self.acts.last().expect("forward first");
        let classes = *self.widths.last().expect("widths");
        labels
            .iter()
            .enumerate()
            .filter(|&(s, &y)| {
                let row = &probs[s * classes..(s + 1) * classes];
                let best = (0..classes)
                    .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                    .expect("classes");
                best == y
            })
            .count()
    }

    /// Gradients of the mean loss of the last forward pass, last layer first; each
    /// parameter's gradient is stored (added to the stored one when `accumulate`), then
    /// reported through `ready(param, gradient)`.
    pub fn backward(
        &mut self,
        labels: &[usize],
        accumulate: bool,
        mut ready: impl FnMut(usize, &[f32]),
    ) {
        let batch = self.batch;
        let layers = self.widths.len() - 1;
        let classes = self.widths[layers];
        // d(loss)/d(logits) = (p − onehot) / batch.
        let mut delta: Vec<f32> = self.acts[layers].clone();
        for (s, &y) in labels.iter().enumerate() {
            delta[s * classes + y] -= 1.0;
        }
        delta.iter_mut().for_each(|d| *d /= batch as f32);
        for l in (0..layers).rev() {
            let (n_in, n_out) = (self.widths[l], self.widths[l + 1]);
            let input = &self.acts[l];
            let mut gw = vec![0.0f32; n_in * n_out];
            let mut gb = vec![0.0f32; n_out];
            for s in 0..batch {
                let d = &delta[s * n_out..(s + 1) * n_out];
                for (g, dv) in gb.iter_mut().zip(d) {
                    *g += dv;
                }
                for i in 0..n_in {
                    let a = input[s * n_in + i];
                    if a != 0.0 {
                        for (g, dv) in gw[i * n_out..(i + 1) * n_out].iter_mut().zip(d) {
                            *g += a * dv;
                        }
                    }
                }
            }
            // The next delta (before this layer's gradients are handed out, as it needs
            // the weights as they are).
            let next = (l > 0).then(|| {
                let w = &self.params[2 * l];
                let mut nd = vec![0.0f32; batch * n_in];
                for s in 0..batch {
                    for i in 0..n_in {
                        if input[s * n_in + i] > 0.0 {
                            nd[s * n_in + i] = w[i * n_out..(i + 1) * n_out]
                                .iter()
                                .zip(&delta[s * n_out..(s + 1) * n_out])
                                .map(|(w, d)| w * d)
                                .sum();
                        }
                    }
                }
                nd
            });
            for (p, g) in [(2 * l + 1, gb), (2 * l, gw)] {
                if accumulate {
                    self.grads[p].iter_mut().zip(&g).for_each(|(a, b)| *a += b);
                } else {
                    self.grads[p] = g;
                }
                ready(p, &self.grads[p]);
            }
            if let Some(nd) = next {
                delta = nd;
            }
        }
    }

    /// Plain SGD: every parameter minus `lr` times its gradient.
    pub fn sgd_step(&mut self, lr: f32) {
        for (p, g) in self.params.iter_mut().zip(&self.grads) {
            p.iter_mut().zip(g).for_each(|(p, g)| *p -= lr * g);
        }
    }

    /// A hash of every parameter's bits (equal hashes: bitwise-equal weights).
    pub fn weights_hash(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for v in self.params.iter().flatten() {
            for b in v.to_bits().to_le_bytes() {
                h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
            }
        }
        h
    }
}

impl Parameters for Mlp {
    fn count(&self) -> usize {
        self.params.len()
    }
    fn param(&mut self, i: usize) -> &mut [f32] {
        &mut self.params[i]
    }
    fn grad(&mut self, i: usize) -> &mut [f32] {
        &mut self.grads[i]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gradients_match_finite_differences() {
        let mut m = Mlp::new(&[5, 7, 3], 1);
        let x: Vec<f32> = (0..4 * 5)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) / 5.0)
            .collect();
        let y = [0, 2, 1, 2];
        m.forward(&x, 4);
        let mut grads: Vec<Vec<f32>> = vec![Vec::new(); 4];
        let mut order = Vec::new();
        m.backward(&y, false, |p, g| {
            grads[p] = g.to_vec();
            order.push(p);
        });
        assert_eq!(order, [3, 2, 1, 0], "last layer first");
        let eps = 1e-3f32;
        for (p, grad) in grads.iter().enumerate() {
            for i in [0, grad.len() / 2, grad.len() - 1] {
                let orig = m.params[p][i];
                m.params[p][i] = orig + eps;
                m.forward(&x, 4);
                let up = m.loss(&y);
                m.params[p][i] = orig - eps;
                m.forward(&x, 4);
                let down = m.loss(&y);
                m.params[p][i] = orig;
                let numeric = (up - down) / (2.0 * eps);
                assert!(
                    (numeric - grad[i]).abs() < 2e-3,
                    "param {p}[{i}]: numeric {numeric}, analytic {}",
                    grad[i]
                );
            }
        }
    }
}
