"""Request state, sampling and the generation loop."""
