//! MoE token grouping and expert GEMV over bf16 weights: the CPU reference for
//! `kernels/cuda/moe.cu`. Assignments (`tokens × k` router choices) are grouped by expert in a
//! stable order so results do not depend on scheduling.

/// `(offsets, order)`: expert `e`'s assignments are `order[offsets[e]..offsets[e + 1]]`, in
/// increasing assignment index. Experts outside `0..num_experts` are an error.
pub fn group_by_expert(experts: &[i32], num_experts: usize) -> Result<(Vec<usize>, Vec<usize>), String> {
    let mut counts = vec![0usize; num_experts];
    for (i, &e) in experts.iter().enumerate() {
        let e = usize::try_from(e).ok().filter(|&e| e < num_experts).ok_or_else(|| format!("assignment {i}: expert {e} outside 0..{num_experts}"))?;
        counts[e] += 1;
    }
    let mut offsets = Vec::with_capacity(num_experts + 1);
    let mut run = 0;
    for c in &counts {
        offsets.push(run);
        run += c;
    }
    offsets.push(run);
    let mut next = offsets.clone();
    let mut order = vec![0; experts.len()];
    for (i, &e) in experts.iter().enumerate() {
        order[next[e as usize]] = i;
        next[e as usize] += 1;
    }
    Ok((offsets, order))
}

/// `out[a, :] = W[experts[a]] · x[a / k]` for every assignment `a`; `weights` is bf16 bits
/// `[experts, rows, cols]`.
pub fn expert_gemv_bf16(weights: &[u16], x: &[f32], experts: &[i32], out: &mut [f32], rows: usize, cols: usize, k: usize) {
    for (a, &e) in experts.iter().enumerate() {
        let xr = &x[(a / k) * cols..][..cols];
        for r in 0..rows {
            let wr = &weights[(e as usize * rows + r) * cols..][..cols];
            out[a * rows + r] = wr.iter().zip(xr).map(|(&w, &v)| half::bf16::from_bits(w).to_f32() * v).sum();
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn grouping_is_stable_and_checks_ids() {
        let (off, order) = super::group_by_expert(&[2, 0, 2, 1, 0, 2], 4).unwrap();
        assert_eq!(off, [0, 2, 3, 6, 6]);
        assert_eq!(order, [1, 4, 3, 0, 2, 5]);
        assert!(super::group_by_expert(&[4], 4).is_err());
        assert!(super::group_by_expert(&[-1], 4).is_err());
    }
}
