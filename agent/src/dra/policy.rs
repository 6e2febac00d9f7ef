//! The `memory` request policy the driver publishes on each GPU, and what a claim consumes
//! under it: the scheduler's rounding (resource.k8s.io/v1 `CapacityRequestPolicy`, KEP-5075),
//! as one pure function ([`Policy::consumed`]) that the tests' allocator applies too.
//!
//! A GPU's policy is a `validRange {min, step, max}` and a `default`: a request below `min`
//! consumes `min`; above it, `min + ceil((request - min) / step) * step`; a rounded request
//! past `max` makes the GPU ineligible; a claim with no request consumes the `default`. The
//! operator sets `min`, `step` and `default` (`--dra-memory-min`, `--dra-memory-step`,
//! `--dra-memory-default`); `max` is the GPU's capacity rounded down onto the step grid, so
//! that every value the policy allows fits on the GPU, and the default is held onto that grid
//! and below `max` (the API server refuses a default the policy does not allow).
//!
//! The defaults, and why:
//! * `min` 1 GiB: a CUDA context alone takes about 0.5 GiB of a quota; a smaller share runs
//!   nothing useful, and a floor keeps a GPU from being cut into hundreds of tiny claims.
//! * `step` 256 MiB: at most 256 MiB of a claim's rounding is lost to the grid, fine enough for
//!   inference servers sized in fractions of a GiB, coarse enough that quotas stay readable.
//! * `default`: the whole GPU (`max`): a claim that names no memory gets the GPU to itself, as
//!   a claim on a driver without shares does; sharing is what a claim asks for by naming it.
use k8s_openapi::{
    api::resource::v1::{CapacityRequestPolicy, CapacityRequestPolicyRange},
    apimachinery::pkg::api::resource::Quantity,
};

/// The operator's default `min`: 1 GiB.
pub const DEFAULT_MIN: u64 = 1 << 30;
/// The operator's default `step`: 256 MiB.
pub const DEFAULT_STEP: u64 = 256 << 20;

/// What the operator asks of every GPU's policy (bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    pub min: u64,
    pub step: u64,
    /// `None`: the whole GPU (`max`).
    pub default: Option<u64>,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings { min: DEFAULT_MIN, step: DEFAULT_STEP, default: None }
    }
}

impl Settings {
    /// Refuses settings no GPU could publish: a zero `min` or `step`, a `default` below `min`.
    pub fn check(&self) -> Result<(), String> {
        if self.min == 0 || self.step == 0 {
            return Err(format!("--dra-memory-min ({}) and --dra-memory-step ({}) must be more than zero", self.min, self.step));
        }
        if let Some(default) = self.default {
            if default < self.min {
                return Err(format!("--dra-memory-default ({default}) is below --dra-memory-min ({})", self.min));
            }
        }
        Ok(())
    }

    /// The policy of a GPU whose `memory` capacity is `capacity` bytes; `None` when the GPU
    /// has less than `min` (no claim could ever fit: it is not published).
    pub fn policy_for(&self, capacity: u64) -> Option<Policy> {
        if capacity < self.min || self.min == 0 || self.step == 0 {
            return None;
        }
        let max = self.min + (capacity - self.min) / self.step * self.step;
        // The default on the grid (rounded up, as a request would be), never past `max`.
        let default = match self.default {
            None => max,
            Some(asked) => grid_up(self.min, self.step, asked).filter(|&d| d <= max).unwrap_or(max),
        };
        Some(Policy { min: self.min, step: Some(self.step), max: Some(max), default: Some(default) })
    }
}

/// A `memory` request policy (bytes): `validRange` and `default`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    pub min: u64,
    pub step: Option<u64>,
    pub max: Option<u64>,
    pub default: Option<u64>,
}

/// `min + ceil((request - min) / step) * step` for a request at or above `min`; `min` below
/// it; `None` past `u64`.
fn grid_up(min: u64, step: u64, request: u64) -> Option<u64> {
    if request <= min {
        return Some(min);
    }
    let steps = (request - min).div_ceil(step);
    steps.checked_mul(step)?.checked_add(min)
}

impl Policy {
    /// What a claim asking `request` bytes (`None`: no request) consumes on a GPU of
    /// `capacity` bytes with this policy, as the scheduler rounds it; `None`: the GPU is not
    /// eligible (the rounded request is past `max` or the capacity). With no request and no
    /// `default`, the whole capacity.
    pub fn consumed(&self, capacity: u64, request: Option<u64>) -> Option<u64> {
        let value = match request {
            None => self.default.unwrap_or(capacity),
            Some(request) => match self.step {
                Some(step) if step > 0 => grid_up(self.min, step, request)?,
                _ => request.max(self.min),
            },
        };
        (value <= self.max.unwrap_or(u64::MAX) && value <= capacity).then_some(value)
    }

    /// As the ResourceSlice carries it (quantities in bytes).
    pub fn to_api(&self) -> CapacityRequestPolicy {
        let quantity = |bytes: u64| Quantity(bytes.to_string());
        CapacityRequestPolicy {
            default: self.default.map(quantity),
            valid_range: Some(CapacityRequestPolicyRange { min: quantity(self.min), step: self.step.map(quantity), max: self.max.map(quantity) }),
            valid_values: None,
        }
    }

    /// A published policy read back (a `validRange` one; `validValues` is not this driver's),
    /// its quantities whole bytes.
    pub fn from_api(api: &CapacityRequestPolicy) -> Result<Policy, String> {
        let bytes = |what: &str, q: &Quantity| crate::quantity::parse_quantity(&q.0).ok_or_else(|| format!("{what} {:?} is not a whole number of bytes", q.0));
        let range = api.valid_range.as_ref().ok_or("the policy has no validRange")?;
        Ok(Policy {
            min: bytes("validRange.min", &range.min)?,
            step: range.step.as_ref().map(|q| bytes("validRange.step", q)).transpose()?,
            max: range.max.as_ref().map(|q| bytes("validRange.max", q)).transpose()?,
            default: api.default.as_ref().map(|q| bytes("default", q)).transpose()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    fn policy() -> Policy {
        Settings::default().policy_for(79 * GIB).expect("a policy")
    }

    #[test]
    fn below_min_is_min_then_up_to_the_step() {
        let p = policy();
        assert_eq!(p.consumed(79 * GIB, Some(1)), Some(GIB), "below min: min");
        assert_eq!(p.consumed(79 * GIB, Some(GIB)), Some(GIB), "min itself");
        assert_eq!(p.consumed(79 * GIB, Some(GIB + 1)), Some(GIB + 256 * MIB), "one byte past min: a step");
        assert_eq!(p.consumed(79 * GIB, Some(8 * GIB)), Some(8 * GIB), "on the grid: as asked");
        assert_eq!(p.consumed(79 * GIB, Some(8 * GIB + 300 * MIB)), Some(8 * GIB + 512 * MIB));
        assert_eq!(p.consumed(79 * GIB, Some(0)), Some(GIB));
    }

    #[test]
    fn past_max_is_not_eligible_and_no_request_is_the_default() {
        let p = policy();
        assert_eq!(p.max, Some(79 * GIB));
        assert_eq!(p.consumed(79 * GIB, Some(79 * GIB)), Some(79 * GIB));
        assert_eq!(p.consumed(79 * GIB, Some(79 * GIB + 1)), None);
        assert_eq!(p.consumed(79 * GIB, Some(u64::MAX)), None, "no overflow");
        assert_eq!(p.consumed(79 * GIB, None), Some(79 * GIB), "the default: the whole GPU");
        let p = Settings { default: Some(4 * GIB), ..Settings::default() }.policy_for(79 * GIB).expect("policy");
        assert_eq!(p.consumed(79 * GIB, None), Some(4 * GIB));
        // Without a policy's default, no request is the whole capacity.
        let bare = Policy { default: None, ..p };
        assert_eq!(bare.consumed(79 * GIB, None), Some(79 * GIB));
        // Without a step, a request above min is as asked.
        let stepless = Policy { step: None, ..p };
        assert_eq!(stepless.consumed(79 * GIB, Some(GIB + 7)), Some(GIB + 7));
    }

    #[test]
    fn max_and_default_lie_on_the_grid_within_the_capacity() {
        // 79.9 GiB: max is the last grid point below it.
        let capacity = 79 * GIB + 900 * MIB;
        let p = Settings::default().policy_for(capacity).expect("policy");
        assert_eq!(p.max, Some(79 * GIB + 768 * MIB));
        assert_eq!(p.default, p.max);
        // A default off the grid is rounded up onto it; one past max is max.
        let p = Settings { default: Some(2 * GIB + 1), ..Settings::default() }.policy_for(capacity).expect("policy");
        assert_eq!(p.default, Some(2 * GIB + 256 * MIB));
        let p = Settings { default: Some(200 * GIB), ..Settings::default() }.policy_for(capacity).expect("policy");
        assert_eq!(p.default, p.max);
        assert_eq!(Settings::default().policy_for(GIB - 1), None, "a GPU smaller than min");
        assert_eq!(Settings::default().policy_for(GIB).map(|p| p.max), Some(Some(GIB)));
    }

    #[test]
    fn settings_are_checked() {
        assert!(Settings::default().check().is_ok());
        assert!(Settings { min: 0, ..Settings::default() }.check().is_err());
        assert!(Settings { step: 0, ..Settings::default() }.check().is_err());
        assert!(Settings { default: Some(GIB - 1), ..Settings::default() }.check().is_err());
    }

    #[test]
    fn the_published_policy_reads_back_the_same() {
        let p = policy();
        let api = p.to_api();
        assert_eq!(api.valid_range.as_ref().map(|r| r.min.0.as_str()), Some("1073741824"));
        assert_eq!(Policy::from_api(&api), Ok(p));
        let with_suffix = CapacityRequestPolicy {
            default: Some(Quantity("8Gi".into())),
            valid_range: Some(CapacityRequestPolicyRange { min: Quantity("1Gi".into()), step: Some(Quantity("256Mi".into())), max: None }),
            valid_values: None,
        };
        assert_eq!(Policy::from_api(&with_suffix), Ok(Policy { min: GIB, step: Some(256 * MIB), max: None, default: Some(8 * GIB) }));
        assert!(Policy::from_api(&CapacityRequestPolicy::default()).is_err());
    }
}
