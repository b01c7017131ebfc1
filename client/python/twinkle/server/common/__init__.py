"""input_feature_to_datum: a Twinkle InputFeature as a tinker Datum (the Tinker path)."""

from twinkle.server.common.datum import input_feature_to_datum

__all__ = ["input_feature_to_datum"]
