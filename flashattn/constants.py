"""The two constants of base-2 softmax, defined once for the reference and the kernels."""

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): turns a base-2 log-sum-exp back into a natural log
