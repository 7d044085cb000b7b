"""Built-in read-only observers: ActivationTrace, ParityAligner, Profiler, NaNWatch."""
