//! Comparing an output with its reference, for the tests that hold a kernel or a model to one.
//!
//! Why not `fold(0.0, f32::max)` over `|got - want|`: `f32::max` returns the other operand when
//! one is NaN, so a NaN output (an uninitialised or out-of-bounds read, a division by zero)
//! would vanish from the maximum and pass any tolerance. Here a NaN or an infinity that the
//! reference does not have is an infinite error.

/// `|got - want|`; 0 where both are the same infinity or both NaN, infinite where only one side
/// is NaN or infinite.
pub fn abs_error(got: f32, want: f32) -> f32 {
    if got == want || (got.is_nan() && want.is_nan()) {
        return 0.0;
    }
    let d = (got - want).abs();
    if d.is_nan() {
        f32::INFINITY
    } else {
        d
    }
}

/// The largest [`abs_error`] over two slices of the same length (infinite if the lengths differ).
pub fn max_abs_error(got: &[f32], want: &[f32]) -> f32 {
    if got.len() != want.len() {
        return f32::INFINITY;
    }
    got.iter().zip(want).map(|(&g, &w)| abs_error(g, w)).fold(0.0, f32::max)
}

/// [`max_abs_error`] relative to the reference's largest magnitude (at least `floor`, so an
/// all-zero reference does not divide by zero).
pub fn max_rel_error(got: &[f32], want: &[f32], floor: f32) -> f32 {
    let scale = want.iter().filter(|v| v.is_finite()).fold(floor, |m, v| m.max(v.abs()));
    max_abs_error(got, want) / scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nan_or_infinity_the_reference_lacks_is_an_infinite_error() {
        assert_eq!(max_abs_error(&[1.0, 2.5], &[1.0, 2.0]), 0.5);
        assert_eq!(max_abs_error(&[1.0, f32::NAN], &[1.0, 2.0]), f32::INFINITY);
        assert_eq!(
            max_abs_error(&[f32::NAN, 1.0], &[2.0, 1.0]),
            f32::INFINITY,
            "NaN first, where f32::max would drop it"
        );
        assert_eq!(max_abs_error(&[1.0, 2.0], &[1.0, f32::NAN]), f32::INFINITY);
        assert_eq!(max_abs_error(&[f32::INFINITY], &[1e30]), f32::INFINITY);
        assert_eq!(max_abs_error(&[f32::NEG_INFINITY, f32::NAN], &[f32::NEG_INFINITY, f32::NAN]), 0.0);
        assert_eq!(max_abs_error(&[1.0], &[1.0, 2.0]), f32::INFINITY, "lengths differ");
        assert_eq!(max_rel_error(&[2.0, 4.5], &[2.0, 4.0], 1e-6), 0.125);
        assert_eq!(max_rel_error(&[0.5], &[0.0], 2.0), 0.25, "the floor scales an all-zero reference");
        assert!(!(max_rel_error(&[f32::NAN], &[1.0], 1e-6) <= 1.0));
    }
}
