"""The dispatch wire protocol: its messages, field checks and the one bounds-checked frame reader."""
