"""The price table: what a GPU-hour, a GB sent and a GB-month stored cost, per region.

The coordinator's configuration states it (``prices:``, optional); usage reports
(:mod:`coordinator.costs.showback`) price what the audit log measured with it.

```yaml
prices:
  currency: USD
  regions:
    us-east:
      market: spot                       # the GPU price that applies (default on_demand)
      gpu_hour:                          # by the GPU kind a job's needs name, or default
        NVIDIA H100 80GB HBM3: {on_demand: 4.10, spot: 1.60}
        default: {on_demand: 2.00, spot: 0.80}
      egress_per_gb: {coordinator: 0.02}   # what it sends the coordinator (or default)
  coordinator:
    egress_per_gb: {eu-west: 0.0, default: 0.09}          # updates sent to each region
  storage:
    archive: {per_gb_month: 0.023}       # a checkpoint location of the storage section
```

A lookup returns None where the table has no price (a region, kind or destination it
does not list and no ``default``): the report says what went unpriced rather than
counting it as free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Final, Literal, Self

from pydantic import Field, model_validator

from geofed.config_sections import ConfigSection

__all__ = ["DEFAULT", "GpuPrice", "PriceTable", "RegionPrices", "StoragePrice"]

#: The key of a price that applies where no other key matches.
DEFAULT: Final = "default"

Price = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]
Market = Literal["on_demand", "spot"]


class GpuPrice(ConfigSection):
    """One GPU-hour of a kind, on demand and (where the region has it) on spot."""

    on_demand: Price
    spot: Price | None = None


class RegionPrices(ConfigSection):
    """A region's prices."""

    market: Market = Field(default="on_demand", description="which GPU price applies")
    gpu_hour: dict[str, GpuPrice] = Field(
        default_factory=dict, description="GPU kind (as job needs name it) or default -> price"
    )
    egress_per_gb: dict[Literal["coordinator", "default"], Price] = Field(
        default_factory=dict,
        description="price of a GB the region sends the coordinator (coordinator, or default)",
    )

    @model_validator(mode="after")
    def _spot_priced(self) -> Self:
        if self.market == "spot":
            missing = sorted(kind for kind, price in self.gpu_hour.items() if price.spot is None)
            if missing:
                raise ValueError(
                    f"market is spot, but gpu_hour {', '.join(missing)} has no spot price"
                )
        return self

    def gpu_hour_price(self, kind: str | None) -> float | None:
        """The price of one GPU-hour of ``kind`` in this region's market (None: unlisted)."""
        price = self.gpu_hour.get(kind or DEFAULT) or self.gpu_hour.get(DEFAULT)
        if price is None:
            return None
        return price.spot if self.market == "spot" else price.on_demand


class CoordinatorPrices(ConfigSection):
    """What the coordinator's site charges for what it sends."""

    egress_per_gb: dict[str, Price] = Field(
        default_factory=dict, description="destination region or default -> price of a GB sent"
    )


class StoragePrice(ConfigSection):
    """A checkpoint location's price."""

    per_gb_month: Price


class PriceTable(ConfigSection):
    """Every price the usage reports apply (see the module docstring)."""

    currency: Annotated[str, Field(pattern=r"^[A-Z]{3}$")] = "USD"
    regions: dict[str, RegionPrices] = Field(default_factory=dict)
    coordinator: CoordinatorPrices = Field(default_factory=CoordinatorPrices)
    storage: dict[str, StoragePrice] = Field(default_factory=dict)

    def gpu_hour(self, region: str, kind: str | None) -> float | None:
        """A GPU-hour of ``kind`` in ``region`` (None: the table has no price for it)."""
        prices = self.regions.get(region)
        return None if prices is None else prices.gpu_hour_price(kind)

    def upload_per_gb(self, region: str) -> float | None:
        """A GB ``region`` sends to the coordinator."""
        prices = self.regions.get(region)
        if prices is None:
            return None
        egress = prices.egress_per_gb
        return egress.get("coordinator", egress.get("default"))

    def download_per_gb(self, region: str) -> float | None:
        """A GB the coordinator sends to ``region``."""
        return _egress(self.coordinator.egress_per_gb, region)

    def storage_per_gb_month(self, location: str) -> float | None:
        """A GB-month in the checkpoint location ``location``."""
        price = self.storage.get(location)
        return None if price is None else price.per_gb_month


def _egress(prices: Mapping[str, float], destination: str) -> float | None:
    price = prices.get(destination)
    return prices.get(DEFAULT) if price is None else price
