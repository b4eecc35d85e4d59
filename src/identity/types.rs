use std::fmt;
use std::sync::Arc;

/// Who is calling: established from authenticated context only.
///
/// Cloning is cheap: one shared `Arc`.
///
/// ```
/// use tower_admission::identity::Identity;
/// let alice = Identity::new("alice", "acme", "free");
/// assert_eq!(alice.subject(), "alice");
/// assert_eq!(alice.plan(), "free");
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Identity(Arc<Names>);

/// The names of an [`Identity`], behind one `Arc`: an identity is cloned
/// into every request it authenticates.
#[derive(PartialEq, Eq, Hash)]
struct Names {
    subject: Arc<str>,
    tenant: Arc<str>,
    plan: Arc<str>,
}

impl Identity {
    /// An identity with a subject (user or client id), tenant and plan.
    pub fn new(
        subject: impl Into<Arc<str>>,
        tenant: impl Into<Arc<str>>,
        plan: impl Into<Arc<str>>,
    ) -> Self {
        Identity(Arc::new(Names {
            subject: subject.into(),
            tenant: tenant.into(),
            plan: plan.into(),
        }))
    }

    /// The authenticated subject, unique within the service.
    pub fn subject(&self) -> &str {
        &self.0.subject
    }

    /// The subject as a shared string, for use as a key without copying.
    pub fn subject_arc(&self) -> &Arc<str> {
        &self.0.subject
    }

    /// The tenant (organisation) the subject belongs to.
    pub fn tenant(&self) -> &str {
        &self.0.tenant
    }

    /// The tenant as a shared string.
    pub fn tenant_arc(&self) -> &Arc<str> {
        &self.0.tenant
    }

    /// The plan, used to pick quota limits.
    pub fn plan(&self) -> &str {
        &self.0.plan
    }
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Identity")
            .field("subject", &self.0.subject)
            .field("tenant", &self.0.tenant)
            .field("plan", &self.0.plan)
            .finish()
    }
}
