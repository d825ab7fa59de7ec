"""The life cycle's orchestration: each stage's workflow over the components, the training stage chain
and its checks, and the local services' start-up. Flows call these; nothing below imports them."""
