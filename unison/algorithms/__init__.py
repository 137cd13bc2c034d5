"""The math of the objective, as registered pure functions over tensors."""
