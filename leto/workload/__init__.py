"""The built-in example job: a small GPT on a byte-level corpus that ships with Python,
trained data-parallel with the resumable updater. faultkit, the benchmarks and the
tests drive it; it is also the reference for what a user's training script does."""
