"""The price provider scheduling asks for ``/api/v1/gpu-types/`` prices and the spot floor."""

from __future__ import annotations

from metering.services.rates import current_price_table, current_prices
from metering.services.spot import current_spot_prices
from scheduling.pricing import price_key


class RateCardPriceProvider:
    """Prices of the default rate card's version in force now, in the region (its own price where
    the card has one); the spot price is the region's market price (``services.spot``) when there
    is one. The spot floor is the rate card's spot price in the region: a spot request may not name
    a maximum below it."""

    def prices(self, *, gpu_model, region):
        return self.price_table(pairs=[(gpu_model, region)])[price_key(gpu_model, region)]

    def price_table(self, *, pairs):
        """``prices`` of many (gpu_model, region) pairs in five queries."""
        listed = current_price_table(gpu_models={m for m, _ in pairs}, regions={r for _, r in pairs})
        market = current_spot_prices(pairs=pairs)
        out = {}
        for m, r in pairs:
            prices = dict(listed[(m.pk, getattr(r, "pk", None))])
            if r is not None and (m.pk, r.pk) in market:
                prices["spot"] = market[(m.pk, r.pk)]
            out[price_key(m, r)] = prices
        return out

    def estimate(self, *, tenant, gpu_model, regions, gpu_count, fraction_milli, cpu_millicores, ram_mib):
        from metering.selectors.shared import hourly_estimate

        return hourly_estimate(
            tenant=tenant,
            gpu_models=[gpu_model],
            regions=regions,
            gpu_count=gpu_count,
            fraction_milli=fraction_milli,
            cpu_millicores=cpu_millicores,
            ram_mib=ram_mib,
        )

    def spot_floor(self, *, gpu_model, region):
        return current_prices(gpu_model=gpu_model, region=region).get("spot")


provider = RateCardPriceProvider()
